"""Hostile strings in every field that reaches the buffer, through a real Explorer on SQLite and
PostgreSQL: each is refused with a 400 naming the field or accepted and recorded; afterwards normal
traffic records and feedback works at once, and nothing acknowledged is missing."""

from __future__ import annotations

import json
import random

import pytest

pytestmark = pytest.mark.integration

HOSTILE = {
    "lone high surrogate": "x\ud800y",
    "lone low surrogate": "\udfff",
    "NUL": "a\x00b",
    "very long": "long " * 20_000,
    "odd but valid unicode": "e\u0301 \u202e\u2028 \ufeff \U0001f642 \uffff",
}
UNSTORABLE = {"lone high surrogate", "lone low surrogate", "NUL"}


def _chat_body(field: str, value: str) -> tuple[dict, str]:
    """A chat body with ``value`` in ``field``; returns (body, the param a 400 must name)."""
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    tool = {"type": "function", "function": {"name": "lookup", "description": "d", "parameters": {"type": "object"}}}
    if field == "content":
        body["messages"][0]["content"] = value
        return body, "messages.0.content"
    if field == "text part":
        body["messages"][0]["content"] = [{"type": "text", "text": value}]
        return body, "messages.0.content.0.text"
    if field == "name":
        body["messages"][0]["name"] = value
        return body, "messages.0.name"
    if field == "tool call arguments":
        body["tools"] = [tool]
        body["messages"] += [
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": value}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        ]
        return body, "messages.1.tool_calls.0.function.arguments"
    if field == "tool result id":
        body["tools"] = [tool]
        body["messages"] += [
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": value, "content": "42"},
        ]
        return body, "messages.2.tool_call_id"
    if field == "tool description":
        tool["function"]["description"] = value
        body["tools"] = [tool]
        return body, "tools.0.function.description"
    if field == "metadata task_id":
        body["metadata"] = {"task_id": value}
        return body, "metadata.task_id"
    if field == "metadata run_id":
        body["metadata"] = {"task_id": "t", "run_id": value}
        return body, "metadata.run_id"
    if field == "metadata key":
        body["metadata"] = {value: "v"}
        return body, "metadata.<key>"
    if field == "stop":
        body["stop"] = [value]
        return body, "stop.0"
    if field == "user":
        body["user"] = value
        return body, "user"
    raise AssertionError(field)


CHAT_FIELDS = ["content", "text part", "name", "tool call arguments", "tool result id", "tool description",
               "metadata task_id", "metadata run_id", "metadata key", "stop", "user"]


def _post(ex, path: str, body: dict):
    # ensure_ascii: a lone surrogate travels as the valid JSON escape "\ud800", as any client would send it
    return ex.http.post(path, content=json.dumps(body, ensure_ascii=True), headers={"Content-Type": "application/json"})


def _fuzz(ex) -> None:
    acknowledged: list[str] = []
    for field in CHAT_FIELDS:
        for kind, value in HOSTILE.items():
            body, param = _chat_body(field, value)
            r = _post(ex, "/v1/chat/completions", body)
            if kind in UNSTORABLE:
                assert r.status_code == 400, (field, kind, r.text)
                err = r.json()["error"]
                assert err["param"] == param and err["code"] == "invalid_string", (field, kind, err)
            else:
                assert r.status_code in (200, 400), (field, kind, r.status_code, r.text[:300])
                if r.status_code == 200:
                    acknowledged += [c["experience_id"] for c in r.json()["choices"]]

    # Feedback and commit bodies, and the X-Task-Id header
    ok = ex.client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    eid = ok.choices[0].model_extra["experience_id"]
    acknowledged.append(eid)
    for kind in UNSTORABLE:
        value = HOSTILE[kind]
        for field, body in [
            ("labels.0", {"msg_ids": [eid], "reward": 1.0, "labels": [value]}),
            ("comment", {"msg_ids": [eid], "reward": 1.0, "comment": value}),
            ("source", {"msg_ids": [eid], "reward": 1.0, "source": value}),
            ("task_id", {"msg_ids": [eid], "reward": 1.0, "task_id": value}),
            ("run_id", {"msg_ids": [eid], "reward": 1.0, "run_id": value}),
            ("msg_ids.0", {"msg_ids": [value], "reward": 1.0}),
        ]:
            r = _post(ex, "/feedback", body)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (kind, field, r.text)
        r = _post(ex, "/commit", {"task_id": value})
        assert r.status_code == 400 and r.json()["error"]["param"] == "task_id", r.text
    r = ex.http.get("/experiences?task_id=a%00b")  # a URL cannot carry a lone surrogate, but NUL it can
    assert r.status_code == 400 and r.json()["error"]["param"] == "query.task_id", r.text
    for path, body in [("/feedback", {"msg_ids": [eid], "reward": 1.0, "task_id": "t" * 257}),
                       ("/feedback", {"msg_ids": [eid], "reward": 1.0, "run_id": "r" * 129}),
                       ("/commit", {"msg_ids": []})]:
        r = _post(ex, path, body)
        assert r.status_code == 400, (path, r.text)
    r = ex.http.post("/v1/chat/completions", json={"model": "default", "messages": [{"role": "user", "content": "x"}],
                                                    "max_tokens": 2}, headers={"X-Task-Id": "h" * 300})
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata.task_id", r.text

    # A random mix of good and bad requests, then normal traffic works within one flush window.
    rng = random.Random(0)
    for _ in range(30):
        body, _param = _chat_body(rng.choice(CHAT_FIELDS), rng.choice(list(HOSTILE.values())))
        r = _post(ex, "/v1/chat/completions", body)
        assert r.status_code in (200, 400), r.text[:300]
        if r.status_code == 200:
            acknowledged += [c["experience_id"] for c in r.json()["choices"]]
    fresh = ex.client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hello"}],
                                              max_tokens=3, metadata={"task_id": "after"})
    fb = ex.http.post("/feedback", json={"msg_ids": [fresh.id], "reward": 1.0}, timeout=5)
    assert fb.status_code == 200, fb.text
    assert ex.http.post("/commit", json={"msg_ids": [fresh.id]}).json()["committed"] == 1
    acknowledged.append(fresh.choices[0].model_extra["experience_id"])

    for e in acknowledged:
        assert ex.http.get(f"/experiences/{e}").status_code == 200, e
    health = ex.http.get("/health").json()
    assert health["status"] == "ok" and health["recorder"]["set_aside"] == 0, health
    assert 'kaizen_recorder_set_aside_total 0.0' in ex.http.get("/metrics").text


def test_hostile_strings_are_refused_at_the_edge_and_recording_goes_on_sqlite(make_explorer):
    _fuzz(make_explorer())


def test_hostile_strings_are_refused_at_the_edge_and_recording_goes_on_postgres(make_explorer, postgres_db_url):
    _fuzz(make_explorer(f"buffer.url={postgres_db_url}"))
