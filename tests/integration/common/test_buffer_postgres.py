"""The buffer on a real PostgreSQL server: the SQLite unit tests again, then what only a server
with concurrent writers can show. Several Explorer replicas (and the Trainer) write to one
database at the same time and must behave like one replica: feedback is all or nothing and
serialisable, a reward replaces the last (after the row is consumed, it is recorded late), no commit
is counted twice, and the Trainer's consume_batch racing a feedback either wins entirely or fails with
BatchChanged (the feedback then wins); when the consume won, the feedback is recorded as late, the
rows stay consumed in the consume's version.
"""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time

import pytest
from sqlalchemy import select, text

from services.common import buffer
from services.common.buffer import BatchChanged
from tests.unit.common import test_buffer as _unit
from tests.unit.common.test_buffer import _exp, db  # noqa: F401 - `db` is the fixture the reused tests take

pytestmark = pytest.mark.integration

# Every behaviour of the SQLite unit tests, rerun here on PostgreSQL through the `buffer_url` below.
for _name in dir(_unit):
    if _name.startswith("test_") and callable(getattr(_unit, _name)):
        globals()[_name] = getattr(_unit, _name)
del _name


@pytest.fixture
def buffer_url(postgres_db_url) -> str:
    return postgres_db_url


@pytest.fixture
def replicas(postgres_db_url):
    """Two engines on one database, as two Explorer replicas (or an Explorer and the Trainer) hold."""
    a = buffer.create_buffer_engine(postgres_db_url)
    b = buffer.create_buffer_engine(postgres_db_url)
    yield a, b
    a.dispose()
    b.dispose()


def _record(engine, n_completions: int, choices: int = 2, prefix: str = "c") -> list[str]:
    cids = [f"{prefix}{i}" for i in range(n_completions)]
    buffer.insert_experiences(
        engine=engine, records=[_exp(cid, j, task=f"t{i % 3}") for i, cid in enumerate(cids) for j in range(choices)]
    )
    return cids


def _rows(engine) -> dict[str, dict]:
    e = buffer.experiences
    q = select(e.c.experience_id, e.c.status, e.c.reward, e.c.feedback, e.c.trained_in)
    with engine.connect() as conn:
        return {r.experience_id: r._asdict() for r in conn.execute(q)}


def _run_together(*calls):
    """Run the calls in threads released at the same instant; their results or exceptions."""
    start = threading.Barrier(len(calls))

    def go(call):
        start.wait()
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - returned for the test to judge
            return e

    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(go, calls))


def _is_acyclic(edges: dict[int, set[int]], nodes: set[int]) -> bool:
    indegree = {n: 0 for n in nodes}
    for src in edges:
        for dst in edges[src]:
            indegree[dst] += 1
    ready = [n for n, d in indegree.items() if d == 0]
    seen = 0
    while ready:
        n = ready.pop()
        seen += 1
        for dst in edges.get(n, ()):
            indegree[dst] -= 1
            if indegree[dst] == 0:
                ready.append(dst)
    return seen == len(nodes)


def test_concurrent_feedback_from_two_replicas_is_all_or_nothing_and_serialisable(replicas):
    a, b = replicas
    cids = _record(a, 12)
    names = cids + [f"{c}-{j}" for c in cids for j in range(2)]
    rng = random.Random(1234)
    calls = {k: rng.sample(names, rng.randint(2, 7)) for k in range(48)}  # random order, completion and choice ids

    def feedback(k):
        return lambda: buffer.apply_feedback(engine=(a, b)[k % 2], msg_ids=calls[k], reward=float(k),
                                             feedback={"call": k})

    results = dict(zip(calls, _run_together(*(feedback(k) for k in calls))))
    errors = {k: r for k, r in results.items() if isinstance(r, Exception)}
    assert not errors, errors  # every id is known and nothing is consumed: no call may fail (no deadlock)

    covered = {k: set(r.experience_ids) for k, r in results.items()}
    for k, ids in calls.items():  # a completion id names all its choices
        assert covered[k] == {e for i in ids for e in (([f"{i}-0", f"{i}-1"]) if "-" not in i else [i])}
    rows = _rows(a)
    edges: dict[int, set[int]] = {}
    for eid, row in rows.items():
        writers = {k for k, ids in covered.items() if eid in ids}
        if not writers:
            assert (row["status"], row["reward"], row["feedback"]) == ("recorded", None, None)
            continue
        winner = row["feedback"]["call"]
        # Reward and note come from the same call (no torn row), and that call named this row.
        assert row["reward"] == float(winner) and winner in writers and row["status"] == "rewarded"
        for loser in writers - {winner}:
            edges.setdefault(loser, set()).add(winner)  # the loser must come before the winner
    # All or nothing: some serial order of the calls explains every row's final value.
    assert _is_acyclic(edges, set(calls)), "two feedbacks each won some of the rows they share"


def test_concurrent_commits_and_feedback_count_each_row_once(replicas):
    a, b = replicas
    cids = _record(a, 15)
    buffer.apply_feedback(engine=a, msg_ids=cids, reward=1.0, feedback={"call": "first"})
    rng = random.Random(99)
    calls = []
    for k in range(24):
        engine = (a, b)[k % 2]
        kind = k % 4
        if kind == 0:
            calls.append(lambda e=engine: ("commit", buffer.commit_experiences(engine=e)))
        elif kind == 1:
            calls.append(lambda e=engine, t=f"t{k % 3}": ("commit", buffer.commit_experiences(engine=e, task_id=t)))
        elif kind == 2:
            ids = rng.sample(cids, 5)
            calls.append(lambda e=engine, ids=ids: ("commit", buffer.commit_experiences(engine=e, msg_ids=ids)))
        else:
            ids = rng.sample(cids, 4)
            calls.append(lambda e=engine, ids=ids, k=k: (
                "feedback", buffer.apply_feedback(engine=e, msg_ids=ids, reward=2.0, feedback={"call": k})))
    results = _run_together(*calls)
    errors = [r for r in results if isinstance(r, Exception)]
    assert not errors, errors
    committed = sum(n for kind, n in results if kind == "commit")
    counts = buffer.count_by_status(engine=b)
    # Every row was rewarded before the race, a feedback never moves a row back from committed,
    # and an unfiltered commit takes every rewarded row: all end committed, each counted once.
    assert counts == {"committed": 30}
    assert committed == 30
    for row in _rows(b).values():
        assert row["reward"] == (1.0 if row["feedback"]["call"] == "first" else 2.0)


def _wait_for_lock_waiters(engine, n: int, timeout: float = 10.0) -> None:
    q = text("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'")
    deadline = time.monotonic() + timeout
    while True:
        with engine.connect() as conn:
            if conn.scalar(q) >= n:
                return
        assert time.monotonic() < deadline, f"fewer than {n} transaction(s) waiting on a row lock"
        time.sleep(0.01)


def _committed_batch(engine, cid: str, reward: float = 1.0) -> dict[str, float]:
    buffer.insert_experiences(engine=engine, records=[_exp(cid, 0), _exp(cid, 1)])
    buffer.apply_feedback(engine=engine, msg_ids=[cid], reward=reward, feedback={})
    assert buffer.commit_experiences(engine=engine, msg_ids=[cid]) == 2
    rows = buffer.fetch_committed(engine=engine, agent="a", limit=100)
    return {r.experience_id: r.reward for r in rows if r.experience_id.startswith(f"{cid}-")}


@pytest.mark.parametrize("first", ["feedback", "consume"])
def test_consume_and_feedback_queued_on_the_same_rows(replicas, first):
    """Both wait on rows a third transaction holds, in a known order; the first one in line wins
    and the second, woken with the rows changed under it, must notice (READ COMMITTED re-reads)."""
    a, b = replicas
    batch = _committed_batch(a, "c9")  # the Trainer read these: committed, reward 1.0
    feedback = lambda: buffer.apply_feedback(engine=a, msg_ids=["c9"], reward=0.5, feedback={"late": True})  # noqa: E731
    consume = lambda: buffer.consume_batch(engine=b, agent="a", step=1, version=7, consumed=batch,  # noqa: E731
                                           discarded=[], state_ref="s1")
    order = [feedback, consume] if first == "feedback" else [consume, feedback]
    with concurrent.futures.ThreadPoolExecutor(2) as pool, a.connect() as holder:
        with holder.begin():
            holder.execute(select(buffer.experiences.c.seq).with_for_update())  # every row, locked
            futures = []
            for n, call in enumerate(order, start=1):
                futures.append(pool.submit(call))
                _wait_for_lock_waiters(b, n)
        outcomes = []
        for f in futures:
            try:
                outcomes.append(f.result(timeout=30))
            except Exception as e:  # noqa: BLE001
                outcomes.append(e)
    rows = _rows(a)
    fb_outcome, consume_outcome = outcomes if first == "feedback" else outcomes[::-1]
    if first == "feedback":
        assert isinstance(fb_outcome, buffer.FeedbackResult), fb_outcome
        assert isinstance(consume_outcome, BatchChanged), consume_outcome
        assert {(r["status"], r["reward"], r["trained_in"]) for r in rows.values()} == {("committed", 0.5, None)}
        assert buffer.last_trainer_step(engine=b, agent="a") is None
    else:
        assert consume_outcome is None, consume_outcome
        assert isinstance(fb_outcome, buffer.FeedbackResult) and fb_outcome.late == ["c9-0", "c9-1"], fb_outcome
        assert {(r["status"], r["reward"], r["trained_in"]) for r in rows.values()} == {("consumed", 0.5, 7)}
        assert [h["late"] for h in buffer.reward_history(engine=a, experience_id="c9-0")] == [False, True]
        assert buffer.last_trainer_step(engine=b, agent="a").version == 7


def test_consume_racing_feedback_wins_entirely_or_not_at_all(replicas):
    a, b = replicas
    outcomes = set()
    for rnd in range(25):
        cid = f"r{rnd}"
        batch = _committed_batch(a, cid)
        # The feedback names one choice of the batch first and the completion (both choices) second,
        # the consume lists them in reverse: the two transactions want the rows in different orders.
        fb, consumed = _run_together(
            lambda: buffer.apply_feedback(engine=a, msg_ids=[f"{cid}-1", cid], reward=0.25, feedback={"r": rnd}),
            lambda: buffer.consume_batch(engine=b, agent="a", step=rnd, version=rnd + 1,
                                         consumed=dict(reversed(batch.items())), discarded=[], state_ref=None),
        )
        rows = {k: v for k, v in _rows(b).items() if k.startswith(f"{cid}-")}
        states = {(r["status"], r["reward"], r["trained_in"]) for r in rows.values()}
        if consumed is None:
            assert isinstance(fb, buffer.FeedbackResult) and len(fb.late) == 2, fb
            assert states == {("consumed", 0.25, rnd + 1)}
            outcomes.add("consume won")
        else:
            assert isinstance(consumed, BatchChanged), consumed
            assert isinstance(fb, buffer.FeedbackResult), fb
            assert states == {("committed", 0.25, None)}
            outcomes.add("feedback won")
    assert outcomes  # which side wins is up to the scheduler; both are correct
