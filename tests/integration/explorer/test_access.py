"""API keys with scopes, agents and quotas, and the audit log, on a real Explorer: each key reaches
what its scopes and agents allow and gets 403 (or 429 with Retry-After) otherwise, in OpenAI's
error shape; keys are configured only as hashes; every feedback, commit and admin action is in
the audit log under the key's name."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from services.common.http.access import key_digest
from tests.integration.adapters import publish_adapter, train_reply_adapter

pytestmark = pytest.mark.integration

KEYS = {
    "app": dict(scopes=["chat", "feedback"], agents=["default"]),
    "other": dict(scopes=["chat", "feedback"], agents=["other"]),
    "reader": dict(scopes=["read"]),
    "ops": dict(scopes=["admin", "read"]),
    "ops-default": dict(scopes=["admin", "read"], agents=["default"]),
    "slow": dict(scopes=["chat"], requests_per_min=2),
    "small": dict(scopes=["chat"], tokens_per_min=40),
    "burst": dict(scopes=["chat"], tokens_per_min=300),
}
SECRET = {name: f"kz-test-{name}-0123456789abcdef" for name in KEYS}
HI = [{"role": "user", "content": "hi"}]


def _override() -> str:
    entries = [{"name": n, "sha256": key_digest(SECRET[n]), **spec} for n, spec in KEYS.items()]
    return "auth.keys=" + json.dumps(entries)


def _client(ex, name: str) -> httpx.Client:
    return httpx.Client(base_url=ex.url, headers={"Authorization": f"Bearer {SECRET[name]}"}, timeout=60)


def _error(r, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and set(err) == {"message", "type", "param", "code"}, err
    return err


def test_scopes_agents_and_the_audit_log(make_explorer):
    ex = make_explorer(_override(), "agents.names=[default, other]")
    assert not any(s in (ex.root / "checkpoints").as_posix() for s in SECRET.values())
    app, other, reader, ops = (_client(ex, n) for n in ("app", "other", "reader", "ops"))

    # chat: its own agent only, pinned names included
    r = app.post("/v1/chat/completions", json={"model": "default", "messages": HI, "max_tokens": 2})
    assert r.status_code == 200, r.text
    eid = r.json()["choices"][0]["experience_id"]
    for model in ("other", "other@v1"):
        err = _error(app.post("/v1/chat/completions", json={"model": model, "messages": HI, "max_tokens": 2}), 403,
                     "agent_not_allowed")
        assert "'app'" in err["message"] and "'other'" in err["message"]
    _error(app.post("/v1/messages", json={"model": "other", "messages": HI, "max_tokens": 2}), 403, "agent_not_allowed")

    # feedback and commit: another agent's experiences are unknown ids to this key (404, as an id that names
    # nothing: the answer does not tell that it exists), all or nothing
    nowhere = _error(other.post("/feedback", json={"msg_ids": ["chatcmpl-nowhere"], "reward": 1.0}), 404, "unknown_id")
    for body in ({"msg_ids": [eid], "reward": 1.0}, {"msg_ids": [eid], "hint": "say hello"},
                 {"msg_ids": [eid], "correction": {"role": "assistant", "content": "hello"}}):
        err = _error(other.post("/feedback", json=body), 404, "unknown_id")
        assert err["message"] == nowhere["message"].replace("chatcmpl-nowhere", eid), err
    # an episode's feedback reaches only the key's own agents' calls: another agent's episode is unknown, unnamed
    r = app.post("/v1/chat/completions", json={"model": "default", "messages": HI, "max_tokens": 2,
                                                "metadata": {"task_id": "t-ep", "run_id": "r1"}})
    episode_call = r.json()["choices"][0]["experience_id"]
    err = _error(other.post("/feedback", json={"task_id": "t-ep", "run_id": "r1", "reward": 1.0}), 404, "unknown_id")
    assert episode_call not in err["message"] and "t-ep" in err["message"], err
    assert app.post("/feedback", json={"msg_ids": [eid], "reward": 1.0}).status_code == 200
    _error(other.post("/commit", json={"msg_ids": [eid]}), 404, "unknown_id")
    assert other.post("/commit", json={}).json()["committed"] == 0  # commit-all reaches only its own agents
    assert app.post("/commit", json={"msg_ids": [eid]}).json()["committed"] == 1
    demo = app.post("/demonstrations", json={"model": "default", "messages": HI,
                                             "response": {"role": "assistant", "content": "hello"}})
    assert demo.status_code == 200, demo.text

    # a stored conversation of another agent cannot be continued (nor read) through the Responses API
    r = app.post("/v1/responses", json={"model": "default", "input": "remember 42", "max_output_tokens": 2})
    assert r.status_code == 200, r.text
    stolen = other.post("/v1/responses", json={"model": "other", "input": "repeat", "previous_response_id": r.json()["id"]})
    _error(stolen, 404, "response_not_found")

    # scopes: chat keys cannot read, readers cannot chat or give feedback, only admins act
    _error(app.get("/experiences"), 403, "insufficient_scope")
    _error(app.get("/metrics"), 403, "insufficient_scope")
    _error(reader.post("/v1/chat/completions", json={"model": "default", "messages": HI}), 403, "insufficient_scope")
    _error(reader.post("/feedback", json={"msg_ids": [eid], "reward": 0.0}), 403, "insufficient_scope")
    _error(reader.post("/admin/rollback", json={"agent": "default"}), 403, "insufficient_scope")
    assert reader.get("/experiences", params={"agent": "default"}).json()["data"][0]["experience_id"] == eid
    assert reader.get(f"/experiences/{eid}").status_code == 200
    assert reader.get("/versions", params={"agent": "default"}).status_code == 200
    assert reader.get("/openapi.json").status_code == 200 and reader.get("/v1/models").status_code == 200
    assert app.get("/v1/models").status_code == 200  # chat clients list models too

    # admin: a rollback by hand, recorded with the key's name
    publish_adapter(train_reply_adapter(ex.state.config.model.path, HI, "hello"), ex.root / "checkpoints", "default", 1)
    r = ops.post("/admin/rollback", json={"agent": "default", "to": 0, "reason": "test"})
    assert r.status_code == 200, r.text
    assert r.json()["decision"]["by"] == "admin:ops"

    audit = ops.get("/admin/audit").json()["data"]
    seen = [(a["actor"], a["action"]) for a in reversed(audit)]
    _error(ops.get("/admin/audit", params={"actor": "a\x00b"}), 400, "invalid_string")
    # refused actions changed nothing and are not there; the empty commit-all is
    assert seen == [("app", "feedback"), ("other", "commit"), ("app", "commit"), ("app", "demonstration"),
                    ("ops", "rollback")], seen
    assert audit[1]["target"] == {"model": "default", "experience_id": demo.json()["experience_id"]}
    assert audit[-1]["target"] == {"msg_ids": [eid], "count": 1} and audit[-1]["details"]["count"] == 1
    assert audit[-1]["details"]["reward"] == 1.0 and audit[-2]["details"]["committed"] == 0
    assert audit[2]["details"]["committed"] == 1 and audit[0]["details"]["reason"] == "test"
    _error(reader.get("/admin/audit"), 403, "insufficient_scope")
    # an admin key limited to agent default reads the actions that name it (the demonstration, the rollback),
    # not the feedback and commits, which name ids only; with limit 1, the newest of those
    limited = _client(ex, "ops-default")
    assert [(a["actor"], a["action"]) for a in limited.get("/admin/audit").json()["data"]] == [
        ("ops", "rollback"), ("app", "demonstration")]
    assert [a["action"] for a in limited.get("/admin/audit", params={"limit": 1}).json()["data"]] == ["rollback"]


def test_a_key_limited_to_agents_reads_only_theirs(make_explorer):
    ex = make_explorer(_override().replace('"reader", "sha256"', '"reader", "agents": ["other"], "sha256"'),
                       "agents.names=[default, other]")
    r = _client(ex, "app").post("/v1/chat/completions", json={"model": "default", "messages": HI, "max_tokens": 2})
    eid = r.json()["choices"][0]["experience_id"]
    reader = _client(ex, "reader")
    _error(reader.get("/experiences"), 403, "agent_not_allowed")
    _error(reader.get("/experiences", params={"agent": "default"}), 403, "agent_not_allowed")
    assert reader.get("/experiences", params={"agent": "other"}).json()["data"] == []
    assert reader.get(f"/experiences/{eid}").status_code == 404  # another agent's: as if it did not exist
    # its models: the base model and its own agents; another agent is a model that does not exist
    listed = [m["id"] for m in reader.get("/v1/models").json()["data"]]
    assert listed == [ex.state.registry.base_name, "other"], listed
    _error(reader.get("/v1/models/default"), 404, "model_not_found")
    assert reader.get("/v1/models/other").json()["version"] == 0
    everything = [m["id"] for m in _client(ex, "ops").get("/v1/models").json()["data"]]
    assert sorted(everything[1:]) == ["default", "other"]


def test_quotas_answer_429_with_retry_after(make_explorer):
    ex = make_explorer(_override())
    slow = _client(ex, "slow")
    body = {"model": "default", "messages": HI, "max_tokens": 2}
    assert [slow.post("/v1/chat/completions", json=body).status_code for _ in range(2)] == [200, 200]
    r = slow.post("/v1/chat/completions", json=body)
    _error(r, 429, "rate_limit_exceeded")
    assert 1 <= int(r.headers["retry-after"]) <= 30  # 2 a minute: one more in 30 s
    assert r.json()["error"]["type"] == "rate_limit_error"

    small = _client(ex, "small")  # 40 tokens a minute: one answer of 40 tokens and its prompt spend it
    r = small.post("/v1/chat/completions", json={**body, "max_tokens": 40, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] > 40, r.text
    _error(small.post("/v1/chat/completions", json=body), 429, "rate_limit_exceeded")
    assert _client(ex, "app").post("/v1/chat/completions", json=body).status_code == 200  # other keys unaffected
    assert 'kaizen_quota_refusals_total{key="slow"} 1.0' in _client(ex, "ops").get("/metrics").text

    # a burst of 8 at once, each reserving its prompt and max_tokens up front: what they use stays within the
    # quota plus one request's worth (charged after the answer, all 8 were admitted on a full bucket)
    burst = _client(ex, "burst")
    asked = {**body, "max_tokens": 40, "temperature": 0}
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: burst.post("/v1/chat/completions", json=asked), range(8)))
    done = [r.json()["usage"] for r in answers if r.status_code == 200]
    refused = [_error(r, 429, "rate_limit_exceeded") for r in answers if r.status_code != 200]
    assert done and refused and "max_tokens" in refused[0]["message"], refused[:1]
    one = done[0]["prompt_tokens"] + 40
    assert sum(u["total_tokens"] for u in done) <= 300 + one + 10, done  # 10: what refills in the burst's 2 s


def test_bad_key_config_is_refused(tmp_path):
    from services.common.config import ConfigError, load_config
    from services.explorer.config import ExplorerConfig

    for bad, needle in [('[{"name": "a", "sha256": "not-hex"}]', "sha256"),
                        ('[{"name": "a", "sha256": "' + "a" * 64 + '", "scopes": ["root"]}]', "scopes"),
                        ('[{"name": "a", "sha256": "' + "a" * 64 + '"}, {"name": "a", "sha256": "' + "b" * 64 + '"}]',
                         "name of its own"),
                        ('[{"name": "release-gate", "sha256": "' + "a" * 64 + '"}]', "reserved")]:
        with pytest.raises(ConfigError, match=needle):
            load_config(ExplorerConfig, None, ["model.path=/m", f"auth.keys={bad}"], env={})
