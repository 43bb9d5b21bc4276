"""Real Explorers on PostgreSQL, driven by the official openai client: what an agent records reaches
the buffer token for token, and two replicas on one database behave like one."""

from __future__ import annotations

import pytest

from services.common import buffer

pytestmark = pytest.mark.integration

USER = [{"role": "user", "content": "hello"}]


def _chat(ex, task_id: str, n: int = 2):
    return ex.client.chat.completions.create(
        model="default", messages=USER, max_tokens=6, n=n,
        extra_body={"return_token_ids": True, "metadata": {"task_id": task_id, "run_id": "0"}},
    )


def _assert_committed_exactly(ex, resp, task_id: str, reward: float) -> None:
    listed = ex.http.get("/experiences", params={"task_id": task_id, "status": "committed"})
    assert listed.status_code == 200, listed.text
    by_id = {e["experience_id"]: e for e in listed.json()["data"]}
    assert set(by_id) == {c.model_extra["experience_id"] for c in resp.choices}
    for choice in resp.choices:
        exp = by_id[choice.model_extra["experience_id"]]
        assert exp["response_token_ids"] == choice.model_extra["token_ids"]
        assert exp["prompt_token_ids"] == resp.model_extra["prompt_token_ids"]
        assert len(exp["response_logprobs"]) == len(exp["response_token_ids"])
        assert (exp["completion_id"], exp["reward"], exp["run_id"]) == (resp.id, reward, "0")


def test_chat_feedback_commit_on_postgres(make_explorer, postgres_db_url):
    ex = make_explorer(f"buffer.url={postgres_db_url}")
    assert ex.state.db.dialect.name == "postgresql"
    resp = _chat(ex, "pg-task")
    fb = ex.http.post("/feedback", json={"msg_ids": [resp.id], "reward": 0.75, "labels": ["good"]})
    assert fb.status_code == 200 and fb.json()["updated"] == 2, fb.text
    c = ex.http.post("/commit", json={"task_id": "pg-task"})
    assert c.json() == {"status": "success", "committed": 2}
    _assert_committed_exactly(ex, resp, "pg-task", 0.75)
    # What the Trainer reads from the same database is the same, token for token.
    trainer_db = buffer.create_buffer_engine(postgres_db_url)
    try:
        rows = buffer.fetch_committed(engine=trainer_db, agent="default", limit=10)
    finally:
        trainer_db.dispose()
    assert {r.experience_id: r.response_token_ids for r in rows} == {
        c.model_extra["experience_id"]: c.model_extra["token_ids"] for c in resp.choices
    }


def test_two_replicas_on_one_database_behave_like_one(make_explorer, postgres_db_url):
    # Replica A holds its records for a while before writing them, so the feedback sent to B right
    # after A answered names ids that are still only in A's memory: B must wait for them, not 404.
    a = make_explorer(f"buffer.url={postgres_db_url}", "recorder.flush_interval_ms=400")
    b = make_explorer(f"buffer.url={postgres_db_url}")
    resp = _chat(a, "shared")
    fb = b.http.post("/feedback", json={"msg_ids": [resp.id], "reward": 0.5})
    assert fb.status_code == 200 and fb.json()["updated"] == 2, fb.text
    # Replaced through A, committed through B; both replicas then show the same committed rows.
    one = resp.choices[1].model_extra["experience_id"]
    assert a.http.post("/feedback", json={"msg_ids": [one], "reward": 1.0}).status_code == 200
    assert b.http.post("/commit", json={"msg_ids": [resp.id]}).json() == {"status": "success", "committed": 2}
    assert a.http.post("/commit", json={}).json() == {"status": "success", "committed": 0}  # counted once
    for ex in (a, b):
        listed = ex.http.get("/experiences", params={"task_id": "shared", "status": "committed"}).json()["data"]
        assert {e["experience_id"]: e["reward"] for e in listed} == {
            resp.choices[0].model_extra["experience_id"]: 0.5, one: 1.0
        }
        assert {e["experience_id"]: e["response_token_ids"] for e in listed} == {
            c.model_extra["experience_id"]: c.model_extra["token_ids"] for c in resp.choices
        }
    # Once the Trainer consumed them, every replica records a new reward as late.
    trainer_db = buffer.create_buffer_engine(postgres_db_url)
    try:
        batch = {r.experience_id: r.reward for r in buffer.fetch_committed(engine=trainer_db, agent="default", limit=10)}
        buffer.consume_batch(engine=trainer_db, agent="default", step=1, version=1, consumed=batch, discarded=[],
                             state_ref=None)
    finally:
        trainer_db.dispose()
    for ex in (a, b):
        late = ex.http.post("/feedback", json={"msg_ids": [resp.id], "reward": 0.0})
        assert late.status_code == 200 and len(late.json()["late"]) == len(resp.choices), late.text
