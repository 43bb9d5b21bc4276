"""The dashboard's app on a real uvicorn server over a real SQLite buffer: what the demo run does not
hold (a demonstration's unsampled tokens, a non-finite float, a key over several agents)."""

from __future__ import annotations

import httpx
import pytest

from services.common import buffer
from services.common.records import Experience
from services.dashboard.app import create_app
from services.dashboard.config import DashboardConfig
from services.common.http.access import key_digest
from tests.helpers import ThreadedServer

pytestmark = pytest.mark.integration


def _exp(i: int, agent: str, logprobs: list[float]) -> Experience:
    return Experience(experience_id=f"c{i}-0", completion_id=f"c{i}", agent=agent, model_version=0, prompt_token_ids=[1],
                      response_token_ids=[4, 5, 6], response_logprobs=logprobs, messages=[{"role": "user", "content": "q"}],
                      response={"role": "assistant", "content": "a"}, sampling={})


@pytest.fixture
def dashboard(tmp_path):
    url = f"sqlite:///{tmp_path}/b.db"
    db = buffer.create_buffer_engine(url)
    buffer.insert_experiences(engine=db, records=[_exp(i, "abc"[i % 3], [-0.5, float("-inf"), -0.1]) for i in range(30)])
    buffer.insert_experiences(engine=db, records=[_exp(99, "a", [])])  # a demonstration: its tokens were never sampled
    db.dispose()
    keys = [{"name": "ab", "sha256": key_digest("kz-ab"), "scopes": ["read"], "agents": ["a", "b"]}]
    config = DashboardConfig.model_validate({"buffer": {"url": url}, "checkpoints": {"root": str(tmp_path / "cp")},
                                             "auth": {"keys": keys}})
    with ThreadedServer(create_app(config)) as server:
        yield server.url


def _get(url, path, **params):
    return httpx.get(url + path, params=params, headers={"Authorization": "Bearer kz-ab"}, timeout=30)


def test_unsampled_tokens_and_non_finite_floats_are_null(dashboard):
    x = _get(dashboard, "/api/experiences/c99-0").json()
    assert [(t["id"], t["logprob"]) for t in x["tokens"]] == [(4, None), (5, None), (6, None)]
    x = _get(dashboard, "/api/experiences/c0-0")
    assert x.status_code == 200 and [t["logprob"] for t in x.json()["tokens"]] == [-0.5, None, -0.1]


def test_a_key_over_two_agents_pages_through_both_in_order(dashboard):
    seen, before = [], None
    while True:
        page = _get(dashboard, "/api/experiences", limit=4, **({"before": before} if before else {})).json()
        seen += [(x["seq"], x["agent"]) for x in page["experiences"]]
        if (before := page["next_before"]) is None:
            break
    assert [s for s, _ in seen] == sorted((s for s, _ in seen), reverse=True)
    assert {a for _, a in seen} == {"a", "b"} and len(seen) == 21  # 10 + 10 + the demonstration; none of c's
    assert [a["name"] for a in _get(dashboard, "/api/agents").json()["agents"]] == ["a", "b"]
    r = _get(dashboard, "/api/overview", agent="c")
    assert r.status_code == 403 and r.json()["error"]["code"] == "agent_not_allowed"
    assert _get(dashboard, "/api/experiences/c2-0").status_code == 404  # c's
