"""Integration fixtures: a fresh real Explorer (uvicorn on loopback, tiny model, its own SQLite buffer) per test."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from services.common.config import load_config
from services.explorer.app import ExplorerState, create_app
from services.explorer.config import ExplorerConfig
from tests.helpers import ThreadedServer


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


@pytest.fixture
def make_explorer(tiny_model, tmp_path):
    stack = contextlib.ExitStack()
    counter = iter(range(100))

    def _make(*overrides: str, api_key: str = "unused", engine=None) -> RunningExplorer:
        n = next(counter)
        root = tmp_path / f"explorer{n}"
        config = load_config(
            ExplorerConfig,
            None,
            [
                f"model.path={tiny_model}",
                f"buffer.url=sqlite:///{root}/buffer.db",
                f"checkpoints.root={root}/checkpoints",
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

    yield _make
    stack.close()


@pytest.fixture
def explorer(make_explorer) -> RunningExplorer:
    return make_explorer()
