"""The Explorer's FastAPI app factory: wires config, engine, adapter registry, recorder and routes.

    app = create_app(config)            # the engine named by config.engine.kind
    app = create_app(config, engine=e)  # tests hand in their own engine
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from datetime import datetime, timedelta, timezone
from pathlib import Path

from fastapi import Depends, FastAPI

from services.common import buffer
from services.common.buffer import create_buffer_engine
from services.common.config import dump_config
from services.common.http.access import Access, make_quotas
from services.explorer.api import (
    chat, demonstrations, experiences, feedback, health, models, privacy, releases, translated,
)
from services.explorer.api.deps import authenticate, require
from services.explorer.api.errors import install_explorer_error_handlers
from services.explorer.config import ExplorerConfig
from services.explorer.edge.backpressure import Backpressure
from services.explorer.edge.metrics import ExplorerMetrics
from services.explorer.edge.middleware import EdgeMiddleware, ServedAddress
from services.explorer.recording.feedback import FeedbackService
from services.explorer.recording.journal import DEAD_LETTERS, Journal
from services.explorer.recording.recorder import Recorder
from services.explorer.release.controller import ReleaseController
from services.explorer.serving.adapters import AdapterRegistry
from services.explorer.serving.chat import ChatService
from services.explorer.serving.demonstrations import DemonstrationService
from services.explorer.serving.engines import Engine, build_engine
from services.explorer.serving.episodes import EpisodePins
from services.explorer.state import ExplorerState
from services.explorer.translate.completions import CompletionsService
from services.explorer.translate.messages import MessagesService
from services.explorer.translate.responses import ResponsesService

log = logging.getLogger(__name__)

async def _retention(state: ExplorerState) -> None:
    """privacy.retention_days: purge the raw text of older experiences now and every purge_interval_s."""
    cfg = state.config.privacy
    while True:
        cutoff = datetime.now(timezone.utc) - timedelta(days=cfg.retention_days)
        total = 0
        try:
            while n := await asyncio.to_thread(buffer.purge_text, engine=state.db, before=cutoff):
                total += n
        except Exception:  # the buffer may be down: try again next time
            log.exception("retention: purging text older than %s failed", cutoff.isoformat())
        if total:
            state.metrics.purged_experiences.inc(total)
            log.info("retention: purged the text of %d experiences recorded before %s", total, cutoff.isoformat())
        await asyncio.sleep(cfg.purge_interval_s)


def create_app(config: ExplorerConfig, *, engine: Engine | None = None) -> FastAPI:
    metrics = ExplorerMetrics()
    engine = engine or build_engine(config)
    db = create_buffer_engine(config.buffer.url)
    Path(config.checkpoints.root).mkdir(parents=True, exist_ok=True)
    rc = config.recorder
    journal_dir = rc.resolve_journal_dir(config.buffer.url)
    recorder = Recorder(
        db=db,
        journal=Journal(journal_dir) if rc.journal and rc.enabled else None,
        dead_letters=journal_dir / DEAD_LETTERS,
        flush_interval_ms=rc.flush_interval_ms,
        max_batch=rc.max_batch,
        max_pending=rc.max_pending,
        on_flush=lambda n, s: (metrics.experiences_recorded.inc(n), metrics.recorder_flush.observe(s)),
        on_set_aside=lambda _record, _why: metrics.recorder_set_aside.inc(),
        journal_max_age_s=rc.journal_max_age_s,
        journal_adopt_s=rc.journal_adopt_s,
    )

    def on_reload(agent: str, version: int, seconds: float) -> None:
        metrics.adapter_reloads.labels(agent).inc()
        metrics.adapter_reload_seconds.observe(seconds)

    pins = EpisodePins(ttl_s=config.reload.episode_pin_s, max_episodes=config.reload.episode_pin_max,
                       db=db if config.reload.pins_in_database(config.buffer.url) else None)
    registry = AdapterRegistry(
        engine=engine,
        checkpoints_root=config.checkpoints.root,
        base_name=config.model.served_name,
        base_aliases=(config.model.path,),
        agents=config.agents.names,
        default_agent=config.agents.default,
        on_reload=on_reload,
        held_versions=pins.held,
    )
    quotas = make_quotas(config.auth, db)
    backpressure = Backpressure(config.backpressure, db=db, metrics=metrics, agents=lambda: sorted(registry.agents))
    chat_service = ChatService(config=config, engine=engine, registry=registry, recorder=recorder, metrics=metrics,
                               episodes=pins, quotas=quotas,
                               backpressure=backpressure if backpressure.enabled else None)
    internal_key = secrets.token_urlsafe(32)  # the release gate's calls to this Explorer's own API
    served = ServedAddress(config.server)
    demo_service = DemonstrationService(engine=engine, registry=registry, db=db)
    state = ExplorerState(
        config=config, engine=engine, db=db, metrics=metrics, recorder=recorder, registry=registry,
        chat=chat_service,
        responses=ResponsesService(chat=chat_service, db=db, recorder=recorder, wait_s=rc.feedback_wait_s),
        messages=MessagesService(chat=chat_service),
        completions=CompletionsService(chat=chat_service),
        feedback=FeedbackService(db=db, recorder=recorder, metrics=metrics, unknown_id_grace_s=rc.unknown_id_grace_s,
                                 wait_s=rc.feedback_wait_s, demonstrations=demo_service,
                                 hint_template=rc.hint_template, hint_role=rc.hint_role, key_ttl_s=rc.feedback_key_ttl_s),
        demonstrations=demo_service,
        releases=ReleaseController(release=config.release, root=config.checkpoints.root, registry=registry, db=db,
                                   metrics=metrics, episodes=pins, api_key=internal_key,
                                   base_url=served.self_url),
        access=Access(config.auth, internal_key=internal_key, quotas=quotas),
        served=served,
    )
    if config.auth.api_keys:
        log.warning("auth.api_keys holds %d plain keys with every scope; auth.keys stores keys hashed, with scopes "
                    "(kaizen key new)", len(config.auth.api_keys))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        log.info("explorer config:\n%s", dump_config(config))
        await engine.start()
        await registry.start()
        await recorder.start()
        if config.reload.enabled:
            state.tasks.append(asyncio.create_task(registry.watch(config.reload.poll_interval_s), name="adapter-watch"))
            state.tasks.append(asyncio.create_task(state.releases.run(), name="release-controller"))
        if backpressure.enabled:
            state.tasks.append(asyncio.create_task(backpressure.run(), name="backpressure"))
        if config.privacy.retention_days is not None:
            state.tasks.append(asyncio.create_task(_retention(state), name="retention"))
        try:
            yield
        finally:
            state.releases.stop()
            for t in state.tasks:
                t.cancel()
            await recorder.stop()
            await engine.shutdown()
            registry.remove_serving_files()
            await asyncio.to_thread(quotas.close)
            await asyncio.to_thread(pins.close)
            db.dispose()

    # /openapi.json is served by api/health.py, behind the key like every other route but /health.
    app = FastAPI(title="Kaizen Explorer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kaizen = state
    install_explorer_error_handlers(app)
    app.include_router(health.router)  # /health alone needs no key
    scoped = {"chat": (chat.router, translated.router), "feedback": (feedback.router, demonstrations.router),
              "read": (experiences.router, health.metrics_router), ("chat", "read"): (models.router,)}
    for scopes, routers in scoped.items():
        for r in routers:
            app.include_router(r, dependencies=[Depends(require(*((scopes,) if isinstance(scopes, str) else scopes)))])
    for r in (releases.router, privacy.router):  # scopes per route: read, admin
        app.include_router(r, dependencies=[Depends(authenticate)])
    server = config.server
    app.add_middleware(EdgeMiddleware, max_body_bytes=server.max_body_bytes, body_timeout_s=server.body_timeout_s,
                       max_concurrent=server.max_concurrent_requests, metrics=metrics, served=served)
    return app
