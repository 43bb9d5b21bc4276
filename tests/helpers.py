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
from typing import Iterator

import httpx

REPO = Path(__file__).resolve().parents[1]


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
