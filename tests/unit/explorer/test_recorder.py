"""The recorder against a real database (SQLite here; PostgreSQL in tests/integration/common):
one refused record never stops the others, an unavailable database loses nothing, and the journal
carries what was not written across a stop or a crash."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from services.common import buffer
from services.common.records import Experience
from services.explorer.recording.journal import DEAD_LETTERS, Journal
from services.explorer.recording.recorder import Recorder, RecordsNotWritten, RecordsSetAside
from tests.helpers import write_locked

# Strings that no buffer database stores; tests/integration/common adds PostgreSQL's own.
POISON = {"lone surrogate": "\ud800"}


def _exp(i: int, task: str | None = "t") -> Experience:
    return Experience(
        experience_id=f"c{i}-0", completion_id=f"c{i}", agent="a", model_version=0, task_id=task,
        prompt_token_ids=[1, 2, 3], response_token_ids=[4], response_logprobs=[-0.5],
        messages=[{"role": "user", "content": "hi"}], response={"role": "assistant", "content": "yo"}, sampling={},
    )


@pytest.fixture
def buffer_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/b.db"


@pytest.fixture
def db(buffer_url):
    engine = buffer.create_buffer_engine(buffer_url, busy_timeout_s=0.2)
    yield engine
    engine.dispose()


def _recorder(db, tmp_path, **kw) -> Recorder:
    return Recorder(db=db, journal=Journal(tmp_path / "journal"), dead_letters=tmp_path / "journal" / DEAD_LETTERS,
                    flush_interval_ms=5, **kw)


def _stored(db) -> set[str]:
    return {e.experience_id for e in buffer.list_experiences(engine=db, limit=1000)}


@pytest.mark.parametrize("poison", list(POISON.values()), ids=list(POISON))
def test_a_refused_record_is_set_aside_and_everyone_elses_are_written(db, tmp_path, poison):
    aside: list[tuple[str, str]] = []

    async def scenario():
        rec = _recorder(db, tmp_path, max_batch=64, on_set_aside=lambda r, why: aside.append((r.experience_id, why)))
        await rec.start()
        rec.record([_exp(i) for i in range(20)])
        rec.record([_exp(20, task=poison)])  # in the middle of a batch
        rec.record([_exp(i) for i in range(21, 40)])
        await rec.wait_written([f"c{i}-0" for i in range(40) if i != 20], timeout=10)
        with pytest.raises(RecordsSetAside, match="c20 could not be recorded"):
            await rec.wait_written(["c20"], timeout=10)
        with pytest.raises(RecordsSetAside):
            await rec.wait_written(["c20"], timeout=10, agents=["a"])
        await rec.wait_written(["c20"], timeout=10, agents=["b"])  # a key limited to agent b: an id naming nothing
        # and recording goes on
        rec.record([_exp(41)])
        await rec.wait_written(["c41-0"], timeout=10)
        health = rec.health()
        await rec.stop()
        return health

    health = asyncio.run(scenario())
    assert _stored(db) == {f"c{i}-0" for i in range(42) if i not in (20, 40)}
    assert [i for i, _ in aside] == ["c20-0"]
    assert health.set_aside == 1 and health.pending == 0
    assert health.problems(degraded_after_s=5, set_aside_window_s=600)  # /health says degraded
    lines = (tmp_path / "journal" / DEAD_LETTERS).read_text().splitlines()
    dead = json.loads(lines[0])
    assert dead["experience"]["experience_id"] == "c20-0" and dead["experience"]["task_id"] == poison  # lossless
    assert dead["reason"]
    assert not list((tmp_path / "journal").glob("segment-*.jsonl"))  # nothing left to replay


def test_a_record_whose_error_says_unavailable_is_set_aside_once_a_probe_shows_the_database_takes_writes(db, tmp_path):
    """A driver error of the "unavailable" kind (an OperationalError, as PostgreSQL's program limits
    are) raised for one record only: the recorder no longer retries it forever."""
    from sqlalchemy import event

    dbapi = db.dialect.loaded_dbapi  # the driver's own error class, as its program limits raise

    def refuse(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith("INSERT INTO EXPERIENCES") and "'too-big'" in repr(parameters):
            raise dbapi.OperationalError("program limit exceeded")  # the kind that usually means "down"

    event.listen(db, "before_cursor_execute", refuse)
    aside: list[str] = []

    async def scenario():
        rec = _recorder(db, tmp_path, max_batch=64, on_set_aside=lambda r, why: aside.append(why))
        await rec.start()
        rec.record([_exp(i) for i in range(10)] + [_exp(10, task="too-big")] + [_exp(i) for i in range(11, 20)])
        await rec.wait_written([f"c{i}-0" for i in range(20) if i != 10], timeout=20)
        with pytest.raises(RecordsSetAside, match="c10 could not be recorded"):
            await rec.wait_written(["c10"], timeout=10)
        failures = rec.failures
        await rec.stop()
        return failures

    failures = asyncio.run(scenario())
    event.remove(db, "before_cursor_execute", refuse)
    assert _stored(db) == {f"c{i}-0" for i in range(20) if i != 10}
    assert failures == 3 and len(aside) == 1 and "program limit exceeded" in aside[0]  # 3 tries, then the probe


def test_an_unavailable_database_loses_nothing_and_feedback_is_told_to_retry(db, tmp_path, buffer_url):
    async def scenario():
        rec = _recorder(db, tmp_path)
        await rec.start()
        with write_locked(buffer_url):
            rec.record([_exp(i) for i in range(10)])
            with pytest.raises(RecordsNotWritten, match="retry later"):
                await rec.wait_written(["c3"], timeout=0.5)
            # another agent's record in flight is not waited for, nor named, for a key limited to agent b
            await asyncio.wait_for(rec.wait_written(["c3"], timeout=0.5, agents=["b"]), 0.2)
            await asyncio.sleep(0.3)
            problems = rec.health().problems(degraded_after_s=0.2, set_aside_window_s=600)
            assert problems and "waited" in problems[0]
            # locked long enough for the probe to be asked (after 3 failures), and to fail (PostgreSQL's lock makes
            # the write wait instead of fail)
            while rec.failures < 5 and db.dialect.name == "sqlite":
                await asyncio.sleep(0.1)
        await rec.wait_written(["c9-0"], timeout=20)  # the lock is gone: written on the next retry
        assert rec.health().problems(degraded_after_s=0.2, set_aside_window_s=600) == []
        assert rec.set_aside_count == 0  # probed while locked: down, nothing set aside
        await rec.stop()

    asyncio.run(scenario())
    assert _stored(db) == {f"c{i}-0" for i in range(10)}


def test_records_not_written_at_stop_stay_in_the_journal_and_are_written_at_the_next_start(db, tmp_path, buffer_url):
    async def first_run():
        rec = _recorder(db, tmp_path)
        await rec.start()
        rec.record([_exp(i) for i in range(5)])
        await rec.stop(timeout=0.5)

    with write_locked(buffer_url):
        # The write fails (SQLite) or blocks (PostgreSQL: it may still land once the lock goes,
        # as it would in a process that was not yet gone) until stop gives up on it.
        t = threading.Thread(target=asyncio.run, args=(first_run(),))
        t.start()
        t.join(5)
        assert list((tmp_path / "journal").glob("segment-*.jsonl"))  # kept for the next start
    t.join(30)

    async def second_run():
        rec = _recorder(db, tmp_path)
        await rec.start()
        assert rec.pending == 5
        await rec.flush(timeout=20)
        await rec.stop()

    asyncio.run(second_run())
    assert _stored(db) == {f"c{i}-0" for i in range(5)}
    assert not list((tmp_path / "journal").glob("segment-*.jsonl"))


def test_a_replayed_record_already_in_the_buffer_is_not_written_twice(db, tmp_path):
    async def scenario():
        rec = _recorder(db, tmp_path)
        await rec.start()
        buffer.insert_experiences(engine=db, records=[_exp(0)])  # e.g. written just before a crash
        rec.record([_exp(0), _exp(1)])
        await rec.flush(timeout=10)
        await rec.stop()

    asyncio.run(scenario())
    assert _stored(db) == {"c0-0", "c1-0"}


def test_contention_is_never_taken_for_a_bad_record():
    import sqlite3

    from sqlalchemy.exc import OperationalError

    from services.explorer.recording.recorder import is_contention

    def wrapped(orig):
        return OperationalError("INSERT ...", {}, orig)

    assert is_contention(wrapped(sqlite3.OperationalError("database is locked")))
    deadlock = Exception("deadlock detected")
    deadlock.sqlstate = "40P01"  # as psycopg's errors carry it
    assert is_contention(wrapped(deadlock))
    assert not is_contention(wrapped(sqlite3.OperationalError("program limit exceeded")))
