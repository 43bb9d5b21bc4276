"""Test helpers: real servers on loopback, in a thread of the test process or as a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import httpx

REPO = Path(__file__).resolve().parents[1]
# test adapters (tests/integration/adapters.py) are kept here, shared by the test workers (tests/conftest.py)
ADAPTER_CACHE_ENV = "KAIZEN_TEST_ADAPTERS"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadedServer:
    """A uvicorn server for ``app`` on a free loopback port, in a background thread."""

    def __init__(self, app, start_timeout: float = 120.0):
        import uvicorn

        self.start_timeout = start_timeout
        self.config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = ""

    def __enter__(self) -> "ThreadedServer":
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("server thread died during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError("server did not start")
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        if self.thread.is_alive():
            self.server.should_exit = True
            self.thread.join(60)


def wait_http(url: str, timeout: float = 180.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


@contextlib.contextmanager
def kaizen_process(*args: str, log_path: Path, env: dict | None = None) -> Iterator[subprocess.Popen]:
    """``kaizen <args>`` as a subprocess; terminated (then killed) on exit."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=full_env
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)


@contextlib.contextmanager
def write_locked(url: str) -> Iterator[None]:
    """Hold the experiences table's write lock from another connection (as a long transaction or
    a stuck process would): SQLite's database write lock, or PostgreSQL's table lock."""
    from sqlalchemy.engine import make_url

    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        import sqlite3

        conn = sqlite3.connect(u.database, isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
    else:
        import psycopg

        conn = psycopg.connect(host=u.host, port=u.port, user=u.username, dbname=u.database)
        conn.execute("LOCK TABLE experiences IN EXCLUSIVE MODE")
    try:
        yield
    finally:
        conn.rollback()
        conn.close()


def run(coro):
    return asyncio.run(coro)


def run_folder(tmp_path_factory) -> Path:
    """The folder of this test run that all its test workers share (pytest-N; a worker's own
    temporary folders are inside it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """The folder ``name``, built by ``build(folder)`` once for the whole test run: the test workers
    of one ``pytest -n`` run share it (the first to ask builds it, under a file lock, while the others
    wait), whichever files they were given. A build that failed fails every later ask with its error,
    without building again. Only for what tests read and never change."""
    import fcntl
    import traceback

    root = run_folder(tmp_path_factory)
    out, failed = root / "built" / name, root / "built" / f"{name}.failed"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(root / "built" / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if failed.exists():
                raise RuntimeError(f"building {name} failed in another test worker:\n{failed.read_text()}")
            if not (out / ".built").exists():
                out.mkdir(exist_ok=True)
                try:
                    build(out)
                except Exception:  # a skip or an interrupt is not remembered: a later ask tries again
                    failed.write_text(traceback.format_exc())
                    raise
                (out / ".built").touch()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out


class PostgresUnavailable(RuntimeError):
    """This machine cannot run a PostgreSQL server of our own (no binaries, or no user to run them as)."""


def _pg_tool(name: str) -> str | None:
    """The newest Debian-packaged PostgreSQL's tool, else the one on PATH."""
    import shutil

    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)
    for d in [*reversed(debian), Path("/usr/local/bin"), Path("/usr/bin")]:
        path = Path(d) / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return shutil.which(name)


@contextlib.contextmanager
def postgres_server(max_connections: int = 300) -> Iterator[str]:
    """A throwaway PostgreSQL server on 127.0.0.1 (trust auth, fsync on): the SQLAlchemy URL of its
    ``postgres`` database; stopped (immediate) and deleted on exit. PostgreSQL refuses to run as root,
    so as root the server runs as the ``postgres`` system user (its data in a temporary directory that
    user owns). Raises PostgresUnavailable when the server binaries, or that user, are missing."""
    import pwd
    import shutil
    import tempfile

    initdb, pg_ctl = _pg_tool("initdb"), _pg_tool("pg_ctl")
    if not (initdb and pg_ctl):
        raise PostgresUnavailable("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    prefix: list[str] = []
    owner = None
    if os.geteuid() == 0:
        runuser = shutil.which("runuser")
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            raise PostgresUnavailable("running as root and there is no 'postgres' system user to run PostgreSQL as") from None
        if not runuser:
            raise PostgresUnavailable("running as root and runuser is missing, so PostgreSQL cannot run as 'postgres'")
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
            raise RuntimeError(f"initdb failed:\n{res.stdout}\n{res.stderr}")
        for _attempt in range(3):  # the free port can be taken before the server binds it
            port = free_port()
            options = (f"-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories={base} "
                       f"-c max_connections={max_connections} -c fsync=on")
            res = pg(pg_ctl, "-D", str(data), "-l", str(log), "-o", options, "-w", "-t", "60", "start")
            if res.returncode == 0:
                started = True
                break
            time.sleep(0.2)
        if not started:
            server_log = log.read_text(errors="replace") if log.exists() else ""
            raise RuntimeError(f"PostgreSQL did not start:\n{res.stdout}\n{res.stderr}\n{server_log[-4000:]}")
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    finally:
        if started:
            pg(pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop", timeout=60)
        shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def fresh_database(postgres_url: str) -> Iterator[str]:
    """A fresh, empty database on the session's PostgreSQL server (its URL), dropped on exit."""
    import uuid

    import psycopg
    from sqlalchemy.engine import make_url

    admin = make_url(postgres_url)
    conninfo = dict(host=admin.host, port=admin.port, user=admin.username, dbname=admin.database, autocommit=True)
    name = f"kaizen_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(**conninfo) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield admin.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(**conninfo) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def chromium() -> Iterator:
    """A real headless Chromium (Debian's, driven by Playwright); the calling test skips, saying why,
    where either is missing."""
    import pytest
    import shutil

    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[test]')")
    exe = next((p for name in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(name))), None)
    if exe is None:
        pytest.skip("no Chromium on this machine (make test installs Debian's chromium when it runs as root with apt)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield browser
        finally:
            browser.close()
