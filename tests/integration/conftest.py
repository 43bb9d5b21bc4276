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


@pytest.fixture(scope="session")
def postgres_url():
    """A PostgreSQL server of our own on 127.0.0.1 (trust auth, fsync on), for the whole session
    (``tests.helpers.postgres_server``): the URL of its ``postgres`` database; use ``postgres_db_url``
    for a fresh database per test. Skips when the server binaries, or a user to run them as, are missing."""
    from tests.helpers import PostgresUnavailable, postgres_server

    with contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(postgres_server())
        except PostgresUnavailable as e:
            pytest.skip(str(e))
        yield url


@pytest.fixture
def postgres_db_url(postgres_url):
    """A fresh, empty database on the session's PostgreSQL server, dropped after the test."""
    with fresh_database(postgres_url) as url:
        yield url
