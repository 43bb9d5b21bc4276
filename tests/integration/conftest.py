"""Integration fixtures: a fresh real Explorer (uvicorn on loopback, tiny model, its own SQLite buffer) per test."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import httpx
import openai
import pytest

from services.common.config import load_config
from services.explorer.app import ExplorerState, create_app
from services.explorer.config import ExplorerConfig
from tests.helpers import ThreadedServer, fresh_database


@dataclass
class RunningExplorer:
    url: str
    state: ExplorerState
    client: openai.OpenAI
    http: httpx.Client
    root: Path
    server: ThreadedServer

    def stop(self) -> None:
        """Shut this Explorer down now (as if it had been killed), mid-test."""
        self.server.__exit__(None, None, None)

    @property
    def tokenizer(self):
        return self.state.engine.tokenizer


@contextlib.contextmanager
def _explorers(tiny_model: Path, folder: Path) -> Iterator[Callable[..., RunningExplorer]]:
    """Starts real Explorers (threads of this process) on the tiny model, each with its own buffer
    and checkpoints under ``folder``; all stopped on exit."""
    stack = contextlib.ExitStack()
    counter = iter(range(100))

    def _make(*overrides: str, api_key: str = "unused", engine=None) -> RunningExplorer:
        n = next(counter)
        root = folder / f"explorer{n}"
        config = load_config(
            ExplorerConfig,
            None,
            [
                f"model.path={tiny_model}",
                f"buffer.url=sqlite:///{root}/buffer.db",
                f"checkpoints.root={root}/checkpoints",
                f"recorder.journal_dir={root}/journal",
                "reload.poll_interval_s=0.2",
                *overrides,
            ],
            env={},
        )
        server = stack.enter_context(ThreadedServer(create_app(config, engine=engine)))
        state = server.config.app.state.kaizen
        headers = {"Authorization": f"Bearer {api_key}"}
        http = stack.enter_context(httpx.Client(base_url=server.url, headers=headers, timeout=120))
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=120)
        return RunningExplorer(url=server.url, state=state, client=client, http=http, root=root, server=server)

    with stack:
        yield _make


@pytest.fixture
def make_explorer(tiny_model, tmp_path):
    with _explorers(tiny_model, tmp_path) as make:
        yield make


@pytest.fixture(scope="module")
def make_module_explorer(tiny_model, tmp_path_factory):
    """make_explorer for an Explorer that a module's tests share (each reads only what it recorded)."""
    with _explorers(tiny_model, tmp_path_factory.mktemp("explorers")) as make:
        yield make


@pytest.fixture
def explorer(make_explorer) -> RunningExplorer:
    return make_explorer()


# ---------------------------------------------------------------------------------------------
# PostgreSQL: one throwaway server per test session, a fresh database per test.


def _pg_tool(name: str) -> str | None:
    """The newest Debian-packaged PostgreSQL's tool, else the one on PATH."""
    import os
    import shutil

    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)
    for d in [*reversed(debian), Path("/usr/local/bin"), Path("/usr/bin")]:
        path = Path(d) / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return shutil.which(name)


@pytest.fixture(scope="session")
def postgres_url():
    """A PostgreSQL server of our own on 127.0.0.1 (trust auth, fsync on), for the whole session.

    Yields the SQLAlchemy URL of its ``postgres`` database; use ``postgres_db_url`` for a fresh
    database per test. PostgreSQL refuses to run as root, so as root the server runs as the
    ``postgres`` system user (its data lives in a temporary directory that user owns). Skips when
    the server binaries, or a user to run them as, are missing. Stopped (immediate) at session end.
    """
    import os
    import pwd
    import shutil
    import subprocess
    import tempfile
    import time

    from tests.helpers import free_port

    initdb, pg_ctl = _pg_tool("initdb"), _pg_tool("pg_ctl")
    if not (initdb and pg_ctl):
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    prefix: list[str] = []
    owner = None
    if os.geteuid() == 0:
        runuser = shutil.which("runuser")
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' system user to run PostgreSQL as")
        if not runuser:
            pytest.skip("running as root and runuser is missing, so PostgreSQL cannot run as 'postgres'")
        prefix = [runuser, "-u", "postgres", "--"]

    base = Path(tempfile.mkdtemp(prefix="kaizen-pg-"))  # not under pytest's mode-700 tmp dirs
    base.chmod(0o755)
    if owner is not None:
        os.chown(base, owner.pw_uid, owner.pw_gid)
    data, log = base / "data", base / "server.log"

    def pg(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([*prefix, *args], cwd=base, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"})

    started = False
    try:
        res = pg(initdb, "-D", str(data), "--auth=trust", "--username=postgres", "--encoding=UTF8",
                 "--locale=C.UTF-8", "--no-sync")
        if res.returncode != 0:
            pytest.fail(f"initdb failed:\n{res.stdout}\n{res.stderr}")
        for _attempt in range(3):  # the free port can be taken before the server binds it
            port = free_port()
            options = (f"-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories={base} "
                       "-c max_connections=300 -c fsync=on")
            res = pg(pg_ctl, "-D", str(data), "-l", str(log), "-o", options, "-w", "-t", "60", "start")
            if res.returncode == 0:
                started = True
                break
            time.sleep(0.2)
        if not started:
            server_log = log.read_text(errors="replace") if log.exists() else ""
            pytest.fail(f"PostgreSQL did not start:\n{res.stdout}\n{res.stderr}\n{server_log[-4000:]}")
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    finally:
        if started:
            pg(pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop", timeout=60)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def postgres_db_url(postgres_url):
    """A fresh, empty database on the session's PostgreSQL server, dropped after the test."""
    with fresh_database(postgres_url) as url:
        yield url
