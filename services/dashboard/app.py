"""The dashboard's web app: a page shell and its assets (no data in them, served to anyone who can
reach the port) and a JSON API under /api that needs a key with the read scope when keys are
configured, and shows a key limited to some agents only those agents.

It reads the buffer, the checkpoint root and (for token texts) the model's tokenizer; it needs
neither the Explorer nor the Trainer to be up, and it never writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import threading
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from sqlalchemy import inspect
from sqlalchemy.engine import Engine, make_url

from services.common.buffer import create_buffer_engine
from services.common.config import ConfigError
from services.common.http.access import Access, Principal, check_agent
from services.common.http.errors import APIError, check_storable, error_response, install_error_handlers, logged_error
from services.dashboard import queries
from services.dashboard.config import DashboardConfig
from services.dashboard.rollups import Rollups

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
PAGES = ("/", "/trainer", "/versions", "/experiences")
_MAX_SEQ = 2**63 - 1
# Scripts from this origin only: recorded prompts and answers are shown as text, and even a mistake
# that put one into the page as markup could not run it.
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'")


def open_buffer(url: str) -> Engine:
    """The buffer, read as it is: an SQLite file must exist and hold the experiences table (the
    dashboard creates nothing)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database
        if not database or database == ":memory:" or not Path(database).expanduser().is_file():
            raise ConfigError(f"buffer.url: no SQLite database at {database!r} (start the Explorer once, or check buffer.url)")
    engine = create_buffer_engine(url, create_tables=False)
    try:
        if not inspect(engine).has_table("experiences"):
            raise ConfigError("buffer.url: the database holds no experiences table (start the Explorer once, or check "
                              "buffer.url)")
        indexes = {i["name"] for i in inspect(engine).get_indexes("experiences")}
        missing = {"ix_experiences_dashboard", "ix_experiences_agent_seq", "ix_experiences_changes"} - indexes
        if missing:
            log.warning("the buffer lacks the indexes %s (an Explorer or Trainer of this version adds them when it "
                        "starts): the overview reads every row of an agent, without rollups, until then",
                        ", ".join(sorted(missing)))
    except ConfigError:
        engine.dispose()
        raise
    except Exception as e:  # cannot connect: say which setting, not the driver's internals
        engine.dispose()
        raise ConfigError(f"buffer.url: cannot read the buffer ({type(e).__name__})") from e
    return engine


class Tokens:
    """Token ids as text, with the model's tokenizer (loaded once, on first use); ids alone without one."""

    def __init__(self, model_path: str | None):
        self.model_path = model_path
        self._tokenizer: Any = None
        self._failed = False
        self._lock = threading.Lock()

    def _load(self):
        with self._lock:
            if self._tokenizer is None and not self._failed and self.model_path:
                try:
                    from transformers import AutoTokenizer

                    self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
                except Exception as e:  # a missing or unreadable model: show ids
                    log.warning("no tokenizer from model.path (%s): tokens are shown as ids", type(e).__name__)
                    self._failed = True
        return self._tokenizer

    def texts(self, ids: list[int]) -> list[str] | None:
        tok = self._load()
        if tok is None:
            return None
        return [tok.decode([i]) for i in ids]


def _finite(node: Any) -> Any:
    """JSON has no NaN or infinity (a -inf logprob, a NaN in feedback): those become null."""
    if isinstance(node, float):
        return node if math.isfinite(node) else None
    if isinstance(node, dict):
        return {k: _finite(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_finite(v) for v in node]
    return node


def _state(request: Request) -> "DashboardState":
    return request.app.state.dashboard


class DashboardState:
    def __init__(self, config: DashboardConfig, db: Engine):
        self.config = config
        self.db = db
        self.root = config.checkpoints.root
        # the dashboard only reads the database: its keys' quotas are counted in this process
        self.access = Access(config.auth, internal_key=secrets.token_urlsafe(32))
        self.tokens = Tokens(config.model.path)
        d = config.dashboard
        self.rollups = (Rollups(db, margin_s=d.change_margin_s, rebuild_s=d.rebuild_s,
                                stale_s=max(60.0, 3 * d.refresh_s)) if d.rollups else None)
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None

    def start(self) -> None:
        """Build the rollups and keep them current, on a thread of their own (the overview reads the
        rows until the first pass ends)."""
        if self.rollups is not None and self._refresher is None:
            self._refresher = threading.Thread(target=self.rollups.run, args=(self.config.dashboard.refresh_s, self._stop),
                                               name="dashboard-rollups", daemon=True)
            self._refresher.start()

    def stop(self) -> None:
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join(timeout=30)
            self._refresher = None


async def reader(request: Request) -> Principal:
    """A caller whose key holds the read scope (401, 403 otherwise; 429 when its quota is spent)."""
    state = _state(request)
    principal = state.access.authenticate(request.headers)
    if "read" not in principal.scopes:
        raise APIError(403, f"API key {principal.name!r} lacks the 'read' scope the dashboard needs",
                       code="insufficient_scope")
    wait = await state.access.quotas.admit_async(principal)
    if wait is not None:
        raise APIError(429, f"the quota of API key {principal.name!r} is spent for now; retry in {math.ceil(wait)} s",
                       code="rate_limit_exceeded", headers={"Retry-After": str(max(1, math.ceil(wait)))})
    return principal


Reader = Annotated[Principal, Depends(reader)]
State = Annotated[DashboardState, Depends(_state)]
Agent = Annotated[str, Query(min_length=1, max_length=128, description="The agent")]


def _visible_agents(state: DashboardState, principal: Principal) -> list[str]:
    return [a for a in queries.agents(state.db, state.root) if principal.may_use(a)]


def _agent(state: DashboardState, principal: Principal, agent: str) -> str:
    check_storable(agent, "agent")
    check_agent(principal, agent, param="agent")
    if not queries.agent_exists(state.db, state.root, agent):
        raise APIError(404, f"no agent named {agent!r} in the buffer or the checkpoints", param="agent",
                       code="unknown_agent")
    return agent


def create_app(config: DashboardConfig, *, db: Engine | None = None) -> FastAPI:
    state = DashboardState(config, db or open_buffer(config.buffer.url))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        state.start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.stop)

    app = FastAPI(title="Kaizen dashboard", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.dashboard = state
    install_error_handlers(app)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):  # OpenAI's shape, no internals (logged under an id)
        return error_response(500, f"the dashboard failed on this request ({logged_error('dashboard error', exc)})",
                              code="server_error")

    @app.middleware("http")
    async def headers(request: Request, call_next):
        response = await call_next(request)
        response.headers["Content-Security-Policy"] = _CSP
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "no-referrer"
        if request.url.path.startswith("/api/"):
            response.headers["Cache-Control"] = "no-store"
        return response

    def shell() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    for path in PAGES:
        app.add_api_route(path, shell, methods=["GET"], include_in_schema=False)
    app.add_api_route("/experiences/{experience_id}", shell, methods=["GET"], include_in_schema=False)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/api/me")
    def me(principal: Reader) -> dict[str, Any]:
        return {"name": principal.name, "scopes": sorted(principal.scopes), "agents": principal.agent_list,
                "auth": state.access.enabled, "refresh_s": config.dashboard.refresh_s}

    @app.get("/api/agents")
    def agents(principal: Reader, st: State) -> dict[str, Any]:
        out = []
        for a in _visible_agents(st, principal):
            figures = st.rollups.figures(a) if st.rollups is not None else None
            out.append({"name": a, **queries.serving(st.root, a),
                        "statuses": queries.status_counts(st.db, a) if figures is None else figures.statuses})
        return {"agents": out}

    @app.get("/api/overview")
    def overview(principal: Reader, st: State, agent: Agent) -> dict[str, Any]:
        return queries.overview(st.db, st.root, _agent(st, principal, agent), st.rollups)

    @app.get("/api/trainer")
    def trainer(principal: Reader, st: State, agent: Agent,
                limit: Annotated[int, Query(ge=1, le=20000)] = 5000) -> dict[str, Any]:
        return queries.trainer(st.db, _agent(st, principal, agent), limit=limit)

    @app.get("/api/versions")
    def versions(principal: Reader, st: State, agent: Agent) -> dict[str, Any]:
        return queries.versions(st.db, st.root, _agent(st, principal, agent), st.rollups)

    @app.get("/api/experiences")
    def experiences(
        principal: Reader, st: State,
        agent: Annotated[str | None, Query(min_length=1, max_length=128)] = None,
        task_id: Annotated[str | None, Query(min_length=1, max_length=256)] = None,
        run_id: Annotated[str | None, Query(min_length=1, max_length=128)] = None,
        version: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
        status: Annotated[str | None, Query()] = None,
        trained_in: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
        min_reward: Annotated[float | None, Query(allow_inf_nan=False)] = None,
        max_reward: Annotated[float | None, Query(allow_inf_nan=False)] = None,
        limit: Annotated[int, Query(ge=1, le=200)] = 50,
        before: Annotated[int | None, Query(ge=1, le=_MAX_SEQ)] = None,
    ) -> dict[str, Any]:
        if status is not None and status not in queries.STATUSES:
            raise APIError(400, f"status must be one of {', '.join(queries.STATUSES)} (got {status!r})", param="status",
                           code="invalid_value")
        check_storable({"agent": agent, "task_id": task_id, "run_id": run_id}, "query")
        if agent is not None:
            check_agent(principal, agent, param="agent")
        f = queries.ExperienceFilter(agents=principal.agent_list, agent=agent, task_id=task_id, run_id=run_id,
                                     version=version, status=status, trained_in=trained_in, min_reward=min_reward,
                                     max_reward=max_reward)
        return queries.search(st.db, f, limit=limit, before=before)

    @app.get("/api/experiences/{experience_id}")
    def experience(principal: Reader, st: State, experience_id: str) -> JSONResponse:
        check_storable(experience_id, "experience_id")
        x = queries.experience(st.db, experience_id) if len(experience_id) <= 96 else None
        if x is None or not principal.may_use(x["agent"]):  # another agent's: as if it did not exist
            raise APIError(404, f"no experience {experience_id[:96]!r}", param="experience_id", code="unknown_id")
        ids = x.pop("response_token_ids") or []
        logprobs = x.pop("response_logprobs") or []  # demonstrations have none: their tokens were not sampled
        texts = st.tokens.texts(ids) if x.get("purged_at") is None else None
        x["tokens"] = [{"id": i, "logprob": logprobs[k] if k < len(logprobs) else None,
                        "text": None if texts is None else texts[k]} for k, i in enumerate(ids)]
        x["tokens_as_text"] = texts is not None
        return JSONResponse(_finite(x))

    return app


def serve(config: DashboardConfig) -> None:
    import uvicorn

    app = create_app(config)
    d = config.dashboard
    print(f"kaizen dashboard: http://{d.host}:{d.port}/ (buffer and checkpoints read only)", flush=True)
    uvicorn.run(app, host=d.host, port=d.port, log_level=d.log_level, access_log=False)
