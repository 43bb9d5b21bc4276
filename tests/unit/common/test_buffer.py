"""Buffer functions against a real SQLite database (one per test); rerun on PostgreSQL by the integration tier."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import update
from sqlalchemy.exc import IntegrityError

from services.common import buffer
from services.common.buffer import AlreadyConsumed, UnknownIds
from services.common.records import Experience, ExperienceStatus


def _exp(cid: str, i: int, task: str | None = "t1") -> Experience:
    return Experience(
        experience_id=f"{cid}-{i}", completion_id=cid, agent="a", model_version=0, task_id=task, run_id=None,
        prompt_token_ids=[1, 2, 3], response_token_ids=[4, 5], response_logprobs=[-0.1, -0.2],
        messages=[{"role": "user", "content": "hi"}], response={"role": "assistant", "content": "yo"},
        sampling={"temperature": 1.0},
    )


@pytest.fixture
def buffer_url(tmp_path) -> str:
    """The database under test; tests/integration/common/test_buffer_postgres.py overrides it."""
    return f"sqlite:///{tmp_path}/b.db"


@pytest.fixture
def db(buffer_url):
    engine = buffer.create_buffer_engine(buffer_url)
    buffer.insert_experiences(engine=engine, records=[_exp("c1", 0), _exp("c1", 1), _exp("c2", 0, task="t2")])
    yield engine
    engine.dispose()


def _status(db, eid):
    return buffer.get_experience(engine=db, experience_id=eid).status.value


def test_feedback_by_completion_id_rewards_every_choice(db):
    res = buffer.apply_feedback(engine=db, msg_ids=["c1"], reward=0.5, feedback={"labels": ["x"]})
    assert res.experience_ids == ["c1-0", "c1-1"]
    e = buffer.get_experience(engine=db, experience_id="c1-1")
    assert e.reward == 0.5 and e.status.value == "rewarded" and e.feedback == {"labels": ["x"]}
    assert _status(db, "c2-0") == "recorded"


def test_feedback_is_all_or_nothing(db):
    with pytest.raises(UnknownIds) as err:
        buffer.apply_feedback(engine=db, msg_ids=["c2-0", "ghost"], reward=1.0, feedback={})
    assert err.value.ids == ["ghost"]
    assert buffer.get_experience(engine=db, experience_id="c2-0").reward is None


def test_feedback_replaces_until_consumed(db):
    buffer.apply_feedback(engine=db, msg_ids=["c2-0"], reward=0.1, feedback={}, task_id="g", run_id="3")
    assert buffer.commit_experiences(engine=db) == 1
    buffer.apply_feedback(engine=db, msg_ids=["c2-0"], reward=0.9, feedback={})
    e = buffer.get_experience(engine=db, experience_id="c2-0")
    assert (e.reward, e.status.value, e.task_id, e.run_id) == (0.9, "committed", "g", "3")
    with db.begin() as conn:
        conn.execute(update(buffer.experiences).values(status="consumed"))
    # once trained on, a reward is still taken (late): the latest, the status kept, the history in the ledger
    result = buffer.apply_feedback(engine=db, msg_ids=["c2-0", "c1-0"], reward=0.0, feedback={"source": "late"})
    assert result.late == ["c1-0", "c2-0"]
    e = buffer.get_experience(engine=db, experience_id="c2-0")
    assert (e.reward, e.status.value) == (0.0, "consumed")
    history = buffer.reward_history(engine=db, experience_id="c2-0")
    assert [(h["reward"], h["late"], h["status_at"], h["outcome"]) for h in history] == [
        (0.1, False, "recorded", "applied"), (0.9, False, "committed", "applied"), (0.0, True, "consumed", "recorded")]
    both = buffer.reward_histories(engine=db, experience_ids=["c2-0", "c1-0", "nope"])  # the list's read, in one query
    assert both["c2-0"] == history and [h["reward"] for h in both["c1-0"]][-1] == 0.0 and both["nope"] == []
    # words cannot teach what was trained already: alone, refused (nothing changes); beside a reward, not kept
    with pytest.raises(AlreadyConsumed):
        buffer.apply_feedback(engine=db, msg_ids=["c2-0"], reward=None, feedback={}, hints={"c2-0": {"text": "x"}})
    assert len(buffer.reward_history(engine=db, experience_id="c2-0")) == 3
    result = buffer.apply_feedback(engine=db, msg_ids=["c2-0"], reward=1.0, feedback={"source": "s" * 500},
                                   hints={"c2-0": {"text": "x"}})
    assert result.hint_not_kept == ["c2-0"] and result.late == ["c2-0"]
    e = buffer.get_experience(engine=db, experience_id="c2-0")
    assert (e.reward, e.hint, e.feedback) == (1.0, None, {})  # a trained row takes the late reward alone
    assert buffer.reward_history(engine=db, experience_id="c2-0")[-1]["source"] == "s" * 128


def test_commit_filters(db):
    buffer.apply_feedback(engine=db, msg_ids=["c1", "c2"], reward=1.0, feedback={})
    assert buffer.commit_experiences(engine=db, task_id="t2") == 1
    assert buffer.commit_experiences(engine=db, msg_ids=["c1-0"]) == 1
    with pytest.raises(UnknownIds):
        buffer.commit_experiences(engine=db, msg_ids=["c1-1", "nope"])
    assert _status(db, "c1-1") == "rewarded"
    assert buffer.commit_experiences(engine=db) == 1
    assert buffer.commit_experiences(engine=db) == 0  # nothing rewarded is left


def test_unrewarded_experiences_are_not_committed(db):
    assert buffer.commit_experiences(engine=db) == 0
    assert buffer.count_by_status(engine=db) == {"recorded": 3}


def test_list_filters_and_order(db):
    assert [e.experience_id for e in buffer.list_experiences(engine=db, task_id="t1")] == ["c1-0", "c1-1"]
    assert [e.experience_id for e in buffer.list_experiences(engine=db, limit=1, offset=2)] == ["c2-0"]
    assert buffer.find_unknown_ids(engine=db, msg_ids=["c1", "c2-0", "zz"]) == ["zz"]


def test_consume_batch_is_atomic_with_its_step(db):
    buffer.apply_feedback(engine=db, msg_ids=["c1", "c2"], reward=1.0, feedback={})
    buffer.commit_experiences(engine=db)
    rows = buffer.fetch_committed(engine=db, agent="a", limit=10)
    assert [r.experience_id for r in rows] == ["c1-0", "c1-1", "c2-0"]
    # The reward of c1-1 changes between reading and consuming: the whole step is refused.
    buffer.apply_feedback(engine=db, msg_ids=["c1-1"], reward=0.0, feedback={})
    with pytest.raises(buffer.BatchChanged):
        buffer.consume_batch(engine=db, agent="a", step=1, version=1, consumed={"c1-0": 1.0, "c1-1": 1.0},
                             discarded=["c2-0"], state_ref="s1")
    assert buffer.last_trainer_step(engine=db, agent="a") is None
    assert buffer.count_by_status(engine=db) == {"committed": 3}
    buffer.consume_batch(engine=db, agent="a", step=1, version=1, consumed={"c1-0": 1.0, "c1-1": 0.0},
                         discarded=["c2-0"], state_ref="s1", metrics={"loss": 0.5})
    assert buffer.count_by_status(engine=db) == {"consumed": 2, "discarded": 1}
    assert sorted(buffer.consumed_ids(engine=db)) == [("c1-0", 1), ("c1-1", 1)]
    assert sorted(buffer.consumed_ids(engine=db, agent="a", trained_in=1)) == [("c1-0", 1), ("c1-1", 1)]
    assert buffer.consumed_ids(engine=db, agent="a", trained_in=2) == []
    last = buffer.last_trainer_step(engine=db, agent="a")
    assert (last.step, last.version, last.state_ref, last.consumed) == (1, 1, "s1", 2)
    with pytest.raises(buffer.BatchChanged):  # already consumed: never twice
        buffer.consume_batch(engine=db, agent="a", step=2, version=2, consumed={"c1-0": 1.0}, discarded=[], state_ref="s2")


def _start_service(url: str, name: str, barrier, results) -> None:
    """One service process starting on the buffer: open it (creating tables) and record a row."""
    try:
        barrier.wait(timeout=60)
        engine = buffer.create_buffer_engine(url)
        buffer.insert_experiences(engine=engine, records=[_exp(name, 0)])
        engine.dispose()
        results.put((name, None))
    except Exception as e:  # noqa: BLE001 - reported to the test
        results.put((name, repr(e)))


def test_services_starting_together_on_a_fresh_database_all_start(buffer_url):
    """An Explorer and a Trainer (or replicas) started at once on a new database must not fail with
    "database is locked" (SQLite's switch to WAL) or "already exists" (racing table creation)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")  # released together by the barrier, no re-import
    n = 6
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_start_service, args=(buffer_url, f"s{i}", barrier, results)) for i in range(n)]
    for p in procs:
        p.start()
    outcomes = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert {name: err for name, err in outcomes.items() if err} == {}
    engine = buffer.create_buffer_engine(buffer_url)
    assert sorted(buffer.get_experience(engine=engine, experience_id=f"s{i}-0").completion_id for i in range(n)) == [
        f"s{i}" for i in range(n)
    ]
    engine.dispose()


def test_a_database_made_by_an_older_version_gains_the_new_columns(buffer_url):
    """create_buffer_engine adds the columns and indexes an older schema lacks; its rows stay readable."""
    from sqlalchemy import MetaData, Table, create_engine, insert, inspect

    from services.common.buffer import create_buffer_engine

    url = buffer_url.replace("postgresql://", "postgresql+psycopg://")
    raw = create_engine(url)
    old = MetaData()
    Table("experiences", old, *[c._copy() for c in buffer.experiences.columns if c.name not in ("user_id", "request_id")])
    old.create_all(raw)
    row = _exp("old", 0).model_dump(mode="python", exclude={"user_id", "request_id"})
    now = buffer.utcnow()
    with raw.begin() as conn:
        conn.execute(insert(old.tables["experiences"]), [{**row, "status": "recorded", "created_at": now, "updated_at": now}])
    raw.dispose()
    engine = create_buffer_engine(buffer_url)
    columns = {c["name"] for c in inspect(engine).get_columns("experiences")}
    assert {"user_id", "request_id"} <= columns
    assert "ix_experiences_user_id" in {i["name"] for i in inspect(engine).get_indexes("experiences")}
    assert buffer.get_experience(engine=engine, experience_id="old-0").user_id is None
    assert {"release_decisions", "audit_log"} <= set(inspect(engine).get_table_names())
    engine.dispose()
    create_buffer_engine(buffer_url).dispose()  # a second start changes nothing


def test_a_versions_lineage_is_an_index_lookup(tmp_path):
    """Publishing reads the new version's lineage; on a buffer of millions of rows that must not
    scan the agent's history (it did: every consumed id, filtered in Python)."""
    from sqlalchemy import text

    db = buffer.create_buffer_engine(f"sqlite:///{tmp_path}/b.db")
    q = buffer.select(buffer.experiences.c.experience_id).where(
        buffer.experiences.c.status == "consumed", buffer.experiences.c.agent == "a", buffer.experiences.c.trained_in == 3)
    sql = str(q.compile(db, compile_kwargs={"literal_binds": True}))
    with db.connect() as conn:
        plan = " ".join(str(row[-1]) for row in conn.execute(text(f"EXPLAIN QUERY PLAN {sql}")))
    assert "ix_experiences_agent_trained_in" in plan, plan


def test_a_late_reward_waits_in_the_ledger_until_a_step_handles_it_once(db):
    buffer.apply_feedback(engine=db, msg_ids=["c1", "c2"], reward=1.0, feedback={})
    buffer.commit_experiences(engine=db)
    buffer.consume_batch(engine=db, agent="a", step=1, version=1, consumed={"c1-0": 1.0, "c1-1": 1.0, "c2-0": 1.0},
                         discarded=[], state_ref=None)
    buffer.apply_feedback(engine=db, msg_ids=["c1-0"], reward=0.0, feedback={})
    buffer.apply_feedback(engine=db, msg_ids=["c1-0", "c2-0"], reward=0.5, feedback={})  # revised again
    pending = buffer.pending_late_rewards(engine=db, agent="a", limit=10)
    assert [e for _, e in pending] == ["c1-0", "c1-0", "c2-0"]
    assert [r.experience_id for r in buffer.fetch_experiences(engine=db, experience_ids=["c2-0", "c1-0"])] == ["c1-0", "c2-0"]
    outcomes = {pending[0][0]: "retrained in v2", pending[1][0]: "retrained in v2", pending[2][0]: "not retrained: stale"}
    buffer.consume_batch(engine=db, agent="a", step=2, version=2, consumed={}, discarded=[], state_ref=None,
                         late_outcomes=outcomes)
    assert buffer.pending_late_rewards(engine=db, agent="a", limit=10) == []
    assert buffer.retrained_in(engine=db, agent="a", version=2) == ["c1-0"]
    # handled rows are never handled again, even if a step names them once more
    buffer.consume_batch(engine=db, agent="a", step=3, version=3, consumed={}, discarded=[], state_ref=None,
                         late_outcomes={pending[0][0]: "retrained in v3"})
    assert buffer.retrained_in(engine=db, agent="a", version=3) == []
    history = buffer.reward_history(engine=db, experience_id="c1-0")
    assert [(h["reward"], h["outcome"]) for h in history] == [(1.0, "applied"), (0.0, "retrained in v2"),
                                                              (0.5, "retrained in v2")]
    # the release gate and the canary read the latest reward, late or revised, not the one trained on
    assert sorted(buffer.version_rewards(engine=db, agent="a", version=0)) == [0.5, 0.5, 1.0]
    assert {r.experience_id: r.reward for r in buffer.recent_rewarded(engine=db, agent="a", limit=10)} == {
        "c1-0": 0.5, "c1-1": 1.0, "c2-0": 0.5}


def test_a_hint_that_arrives_while_a_step_trains_its_call_redoes_the_step(db):
    """An objective that learns from hints trained c1-0 without one; a hint sent meanwhile would be lost
    (the call is consumed), so the step is refused like a changed reward, and redone with the hint."""
    buffer.apply_feedback(engine=db, msg_ids=["c1", "c2"], reward=1.0, feedback={})
    buffer.commit_experiences(engine=db)
    step = dict(engine=db, agent="a", consumed={"c1-0": 1.0, "c1-1": 1.0}, discarded=[], state_ref="s1")
    buffer.apply_feedback(engine=db, msg_ids=["c1-0"], reward=None, feedback={},
                          hints={"c1-0": {"text": "use the tool", "prompt_token_ids": [1, 2]}})
    with pytest.raises(buffer.BatchChanged, match="a hint arrived"):
        buffer.consume_batch(step=1, version=1, unhinted=["c1-0", "c1-1"], **step)
    assert buffer.count_by_status(engine=db) == {"committed": 3}
    # read with its hint this time (or by an objective that ignores hints): consumed
    buffer.consume_batch(step=1, version=1, unhinted=["c1-1"], **step)
    assert buffer.count_by_status(engine=db) == {"consumed": 2, "committed": 1}

def _key(key: str = "k1", body: str = "body-1", actor: str = "alice", ttl_s: float = 86_400.0) -> buffer.IdempotencyKey:
    return buffer.IdempotencyKey(actor=actor, key=key, request_hash=body, ttl_s=ttl_s)


def test_a_feedback_sent_twice_under_one_key_is_applied_once(db):
    first = buffer.apply_feedback(engine=db, msg_ids=["c1"], reward=0.5, feedback={}, idempotency=_key())
    assert not first.replayed and first.experience_ids == ["c1-0", "c1-1"]
    buffer.apply_feedback(engine=db, msg_ids=["c1-0"], reward=0.7, feedback={})  # another feedback in between
    again = buffer.apply_feedback(engine=db, msg_ids=["c1"], reward=0.5, feedback={}, idempotency=_key())
    assert again.replayed and again.experience_ids == first.experience_ids
    assert buffer.get_experience(engine=db, experience_id="c1-0").reward == 0.7  # the retry changed nothing
    assert [h["reward"] for h in buffer.reward_history(engine=db, experience_id="c1-1")] == [0.5]  # one ledger row
    assert buffer.replayed_feedback(engine=db, idempotency=_key()).replayed
    # the same key from another API key is another feedback; the same key with another body is refused
    assert not buffer.apply_feedback(engine=db, msg_ids=["c1-1"], reward=0.2, feedback={},
                                     idempotency=_key(actor="bob")).replayed
    with pytest.raises(buffer.IdempotencyKeyReused):
        buffer.apply_feedback(engine=db, msg_ids=["c1-1"], reward=0.9, feedback={}, idempotency=_key(body="body-2"))
    assert buffer.get_experience(engine=db, experience_id="c1-1").reward == 0.2


def test_a_refused_feedback_keeps_no_key_and_old_keys_expire(db):
    with pytest.raises(UnknownIds):
        buffer.apply_feedback(engine=db, msg_ids=["ghost"], reward=1.0, feedback={}, idempotency=_key())
    assert buffer.replayed_feedback(engine=db, idempotency=_key()) is None  # nothing applied: a retry may succeed
    buffer.apply_feedback(engine=db, msg_ids=["c2-0"], reward=1.0, feedback={}, idempotency=_key("old"))
    with buffer.write_transaction(db) as conn:  # make "old" two days old
        conn.execute(update(buffer.feedback_keys).values(created_at=buffer.utcnow() - timedelta(days=2)))
    assert buffer.replayed_feedback(engine=db, idempotency=_key("old")) is None  # expired, even before it is pruned
    buffer.apply_feedback(engine=db, msg_ids=["c1-0"], reward=1.0, feedback={}, idempotency=_key("new"))
    assert buffer.replayed_feedback(engine=db, idempotency=_key("old")) is None  # pruned past its ttl
    assert buffer.replayed_feedback(engine=db, idempotency=_key("new")) is not None


def test_a_correction_is_stored_with_its_feedback_or_not_at_all(db):
    fix = _exp("demo-fix", 0).model_copy(update={"status": ExperienceStatus.COMMITTED})
    with pytest.raises(UnknownIds):  # an unknown id beside it: the correction is not stored either
        buffer.apply_feedback(engine=db, msg_ids=["c2-0", "ghost"], reward=0.0, feedback={}, corrections=[fix])
    assert buffer.get_experience(engine=db, experience_id="demo-fix-0") is None
    res = buffer.apply_feedback(engine=db, msg_ids=["c2-0"], reward=None, feedback={}, corrections=[fix])
    assert res.experience_ids == [] and res.demonstration_ids == ["demo-fix-0"]
    assert _status(db, "demo-fix-0") == "committed"
    assert _status(db, "c2-0") == "recorded"  # a correction alone leaves the call it corrects as it was


def test_an_audit_row_is_written_with_what_it_records_or_neither_is(db):
    bad = {"actor": "ops", "action": None, "target": {"agent": "a"}, "details": {}}  # action NOT NULL: the write fails
    with pytest.raises(IntegrityError):
        buffer.record_decision(engine=db, agent="a", version=2, decision="rejected", serving=1, actor="admin:ops",
                               reason="by hand", audit=bad)
    assert buffer.list_decisions(engine=db, agent="a") == [] and buffer.list_audit(engine=db) == []
    with pytest.raises(IntegrityError):
        buffer.insert_experiences(engine=db, records=[_exp("demo-x", 0)], audit=bad)
    assert buffer.get_experience(engine=db, experience_id="demo-x-0") is None
    good = {**bad, "action": "release_reject"}
    d = buffer.record_decision(engine=db, agent="a", version=2, decision="rejected", serving=1, actor="admin:ops",
                               reason="by hand", audit=good)
    buffer.insert_experiences(engine=db, records=[_exp("demo-x", 0)], audit={**good, "action": "demonstration"})
    assert [x.id for x in buffer.list_decisions(engine=db, agent="a")] == [d.id]
    assert [(r["actor"], r["action"]) for r in buffer.list_audit(engine=db)] == [("ops", "demonstration"),
                                                                                ("ops", "release_reject")]


def test_a_users_record_made_before_their_deletion_is_never_written_after_it(db):
    """A record another replica still held (queued, or in its journal) when the user's data was
    deleted is dropped when it arrives; one made after the deletion is kept, as is one for an agent
    the deletion did not cover."""
    from datetime import datetime, timedelta, timezone

    def mine(cid: str, agent: str, created: datetime) -> Experience:
        return _exp(cid, 0).model_copy(update={"user_id": "u1", "agent": agent, "created_at": created})

    before = datetime.now(timezone.utc) - timedelta(seconds=5)
    assert buffer.insert_experiences(engine=db, records=[mine("u-a", "a", before)]) == 1
    assert buffer.delete_user_data(engine=db, user_id="u1", agents=["a"])["deleted"] == 1
    after = datetime.now(timezone.utc) + timedelta(seconds=1)
    late = [mine("u-late", "a", before), mine("u-b", "b", before), mine("u-new", "a", after), _exp("c9", 0)]
    assert buffer.insert_experiences(engine=db, records=late) == 3
    assert buffer.insert_missing_experiences(engine=db, records=[mine("u-replayed", "a", before)]) == 0
    ids = {x.experience_id for x in buffer.list_experiences(engine=db, limit=100)}
    assert {"u-b-0", "u-new-0", "c9-0"} <= ids and not ids & {"u-late-0", "u-a-0", "u-replayed-0"}
    # a deletion for every agent covers b's too (u-new was made "after" the first deletion, in the future)
    made = datetime.now(timezone.utc)
    assert buffer.delete_user_data(engine=db, user_id="u1")["deleted"] == 2
    assert buffer.insert_experiences(engine=db, records=[mine("u-b2", "b", made)]) == 0
    # a key limited to no agent deletes nothing, and says so
    assert buffer.delete_user_data(engine=db, user_id="u1", agents=[])["deleted"] == 0


def test_two_retention_passes_at_once_purge_each_row_once(db, buffer_url):
    """Every replica runs retention: two passes at once (two engines, as two replicas) count each
    purged row once between them."""
    from concurrent.futures import ThreadPoolExecutor
    from datetime import datetime, timedelta, timezone

    old = datetime.now(timezone.utc) - timedelta(days=40)
    buffer.insert_experiences(engine=db, records=[_exp(f"old{i}", 0).model_copy(update={"created_at": old})
                                                  for i in range(200)])
    engines = [buffer.create_buffer_engine(buffer_url) for _ in range(2)]
    try:
        cutoff = datetime.now(timezone.utc) - timedelta(days=30)
        with ThreadPoolExecutor(2) as pool:
            counts = list(pool.map(lambda e: sum(iter(lambda: buffer.purge_text(engine=e, before=cutoff, limit=50), 0)),
                                   engines))
    finally:
        for e in engines:
            e.dispose()
    assert sum(counts) == 200, counts
