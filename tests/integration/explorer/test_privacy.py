"""Governance of recorded data on a real Explorer: redaction at record time (the text stored, the
ids dropped or kept by the stated rule), consent, per-user identity, deleting a user's data, and
retention purging raw text while rewards and lineage stay."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import update

from services.common import buffer
from services.common.http.access import key_digest

pytestmark = pytest.mark.integration

PII = "mail jane.doe@example.com, call +1 415-555-0100, card 4111 1111 1111 1111, say secret"


def upper_secret(text: str) -> str:
    """A user redactor (privacy.redactor points here)."""
    return text.replace("secret", "[x]")


def _chat(ex, content: str, **extra) -> str:
    r = ex.http.post("/v1/chat/completions", json={"model": "default", "messages": [{"role": "user", "content": content}],
                                                   "max_tokens": 3, **extra}, headers=extra.pop("headers", None))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["experience_id"]


def _stored(ex, eid: str) -> dict:
    r = ex.http.get(f"/experiences/{eid}")
    assert r.status_code == 200, r.text
    return r.json()


def _reward_and_commit(ex, eid: str) -> int:
    assert ex.http.post("/feedback", json={"msg_ids": [eid], "reward": 1.0}).status_code == 200
    return ex.http.post("/commit", json={"msg_ids": [eid]}).json()["committed"]


def test_redaction_drops_ids_by_default_and_keeps_them_when_told(make_explorer):
    ex = make_explorer("privacy.redact=[email, phone, card]",
                       "privacy.redactor=tests.integration.explorer.test_privacy:upper_secret")
    eid = _chat(ex, PII)
    e = _stored(ex, eid)
    assert e["messages"][0]["content"] == "mail [email], call [phone], card [card], say [x]"
    assert e["prompt_token_ids"] == [] and e["response_token_ids"] == [] and e["response_logprobs"] == []
    assert e["trainable"] is False and e["privacy"] == {"redacted": ["card", "custom", "email", "phone"], "ids": "dropped"}
    assert _reward_and_commit(ex, eid) == 0 and _stored(ex, eid)["status"] == "discarded"  # never trained
    clean = _chat(ex, "what is 2 + 2?")  # nothing to redact: stored as ever
    e = _stored(ex, clean)
    assert e["prompt_token_ids"] and e["privacy"] is None and _reward_and_commit(ex, clean) == 1

    keep = make_explorer("privacy.redact=[email]", "privacy.redacted_ids=keep")
    eid = _chat(keep, "mail jane.doe@example.com")
    e = _stored(keep, eid)
    assert e["messages"][0]["content"] == "mail [email]" and e["prompt_token_ids"]
    assert "jane.doe@example.com" in keep.tokenizer.decode(e["prompt_token_ids"])
    assert e["privacy"]["ids"].startswith("kept") and e["trainable"] is None and _reward_and_commit(keep, eid) == 1


def test_consent_and_user_identity(make_explorer):
    keys = [{"name": "optout", "sha256": key_digest("k-optout"), "scopes": ["chat", "feedback", "read"], "train": False},
            {"name": "ops", "sha256": key_digest("k-ops"), "scopes": ["chat", "feedback", "read", "admin"]}]
    ex = make_explorer("auth.keys=" + json.dumps(keys), api_key="k-ops")
    no = _chat(ex, "hi", metadata={"train": False, "user_id": "u-1"})
    yes = _chat(ex, "hi", headers={"X-User-Id": "u-2", "X-Request-Id": "req-42"})
    assert _stored(ex, no)["user_id"] == "u-1" and _stored(ex, no)["trainable"] is False
    assert _stored(ex, yes)["user_id"] == "u-2" and _stored(ex, yes)["request_id"] == "req-42"
    assert _reward_and_commit(ex, no) == 0 and _reward_and_commit(ex, yes) == 1
    r = ex.http.post("/v1/messages", json={"model": "default", "messages": [{"role": "user", "content": "hi"}],
                                           "max_tokens": 2, "metadata": {"train": False, "user_id": "u-3"}})
    stored = _stored(ex, r.json()["experience_id"] if "experience_id" in r.json() else r.json()["id"] + "-0")
    assert stored["user_id"] == "u-3" and stored["trainable"] is False  # Anthropic's clients send metadata.user_id
    r = ex.http.post("/v1/chat/completions", json={"model": "default", "messages": [{"role": "user", "content": "x"}],
                                                   "metadata": {"train": "maybe"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata.train"
    # A key whose traffic is not for training by default; a request may still opt in.
    r = ex.http.post("/v1/chat/completions", headers={"Authorization": "Bearer k-optout"},
                     json={"model": "default", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    assert _stored(ex, r.json()["choices"][0]["experience_id"])["trainable"] is False
    r = ex.http.post("/v1/chat/completions", headers={"Authorization": "Bearer k-optout"},
                     json={"model": "default", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                           "metadata": {"train": True}})
    assert _stored(ex, r.json()["choices"][0]["experience_id"])["trainable"] is None


def test_deleting_a_users_data_reports_what_was_trained(make_explorer):
    ex = make_explorer()
    ids = {status: _chat(ex, f"hello {status}", metadata={"user_id": "u-9"}) for status in ("recorded", "committed", "consumed")}
    other = _chat(ex, "hello", metadata={"user_id": "u-10"})
    for status in ("committed", "consumed"):
        _reward_and_commit(ex, ids[status])
    # The Trainer's step 1 trained v1 on one of them (the buffer call it makes).
    buffer.consume_batch(engine=ex.state.db, agent="default", step=1, version=1, consumed={ids["consumed"]: 1.0},
                         discarded=[], state_ref="s1")
    journal = ex.root / "journal"
    assert "hello recorded" in "".join(p.read_text() for p in journal.glob("segment-*.jsonl"))  # its text, on disk
    r = ex.http.delete("/experiences", params={"user_id": "u-9"})
    assert r.status_code == 200, r.text
    assert r.json() == {"user_id": "u-9", "deleted": 3, "by_status": {"recorded": 1, "committed": 1, "consumed": 1},
                        "in_published_versions": [{"agent": "default", "version": 1, "experiences": 1}],
                        "journal": {"journal_sealed": True, "dead_letters_dropped": 0, "journal_max_age_s": 60.0}}
    # the journal's segment that held their text is gone (every record in it was written: nothing waits in it)
    assert "hello" not in "".join(p.read_text() for p in journal.glob("segment-*.jsonl"))
    for eid in ids.values():
        assert ex.http.get(f"/experiences/{eid}").status_code == 404
    assert ex.http.get(f"/experiences/{other}").status_code == 200
    # A journal replayed after the deletion (a kill before its segment rotated) writes none of them again.
    gone = buffer.get_experience(engine=ex.state.db, experience_id=other)
    for status, eid in ids.items():
        buffer.insert_missing_experiences(engine=ex.state.db, records=[gone.model_copy(update={"experience_id": eid})])
        assert ex.http.get(f"/experiences/{eid}").status_code == 404
    assert ex.http.delete("/experiences", params={"user_id": "u-9"}).json()["deleted"] == 0
    assert ex.http.delete("/experiences").status_code == 400  # user_id is required
    audit = ex.http.get("/admin/audit", params={"action": "delete_user_data"}).json()["data"]
    assert [a["details"]["deleted"] for a in audit] == [0, 3] and audit[1]["actor"] == "anonymous"


def test_retention_purges_old_text_and_keeps_rewards(make_explorer):
    ex = make_explorer("privacy.retention_days=1", "privacy.purge_interval_s=0.2")
    r = ex.http.post("/v1/responses", json={"model": "default", "input": "an old question", "max_output_tokens": 3})
    assert r.status_code == 200, r.text
    response_id, old = r.json()["id"], r.json()["experience_id"]
    fresh = _chat(ex, "a new question")
    assert ex.http.post("/feedback", json={"msg_ids": [old], "hint": "say more"}).status_code == 200
    _reward_and_commit(ex, old)
    e = buffer.experiences.c
    with buffer.write_transaction(ex.state.db) as conn:  # recorded two days ago
        conn.execute(update(buffer.experiences).where(e.experience_id == old)
                     .values(created_at=datetime.now(timezone.utc) - timedelta(days=2)))
    deadline = time.monotonic() + 30
    while _stored(ex, old)["purged_at"] is None and time.monotonic() < deadline:
        time.sleep(0.2)
    purged = _stored(ex, old)
    assert purged["purged_at"] and purged["messages"] == [] and purged["prompt_token_ids"] == []
    assert purged["hint"] is None  # words, and the teacher's prompt (the conversation's ids), go too
    assert purged["reward"] == 1.0 and purged["status"] == "discarded" and purged["model_version"] == 0
    assert _stored(ex, fresh)["messages"]  # younger than the retention period
    r = ex.http.post("/v1/responses", json={"model": "default", "input": "go on", "previous_response_id": response_id})
    assert r.status_code == 404 and "retention" in r.json()["error"]["message"]
    assert "kaizen_purged_experiences_total 1.0" in ex.http.get("/metrics").text
