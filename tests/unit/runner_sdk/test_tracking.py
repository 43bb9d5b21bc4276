"""What a tracked HTTP client adds to a chat request made inside an agent run."""

from __future__ import annotations

import httpx

from runner_sdk.client import _track
from runner_sdk.context import running
from runner_sdk.records import AgentRun


def _chat() -> httpx.Request:
    return httpx.Request("POST", "http://explorer/v1/chat/completions", json={})


def test_a_selected_run_names_its_episode_and_a_shadow_run_asks_to_explore():
    with running(AgentRun(task_id="t", run_id="2", selected=True)):
        r = _chat()
        _track(r)
    assert r.headers["X-Task-Id"] == "t" and r.headers["X-Run-Id"] == "2" and "X-Explore" not in r.headers
    with running(AgentRun(task_id="t", run_id="3", selected=True, explore=True)):
        r = _chat()
        _track(r)
    assert r.headers["X-Explore"] == "true"
    with running(AgentRun(task_id="t", run_id="4", selected=False, explore=True)):  # not selected: nothing tracked
        r = _chat()
        assert _track(r) is None
    assert "X-Explore" not in r.headers and "X-Task-Id" not in r.headers
