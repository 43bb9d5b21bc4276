"""Writes experiences to the buffer in small batches, off the request's hot path, and never stops.

A chat request hands its records over and returns at once: they are appended to the local journal
(services/explorer/recording/journal.py) before the answer leaves, so an answered chat survives the Explorer
being killed, and queued in memory. A background task writes whatever is pending every
``flush_interval_ms`` (or as soon as ``max_batch`` records wait) in one transaction, after one
group fsync of the journal.

Two kinds of failure, two answers:
- the database is unavailable (down, unreachable, write-locked): the batch stays and is retried
  with backoff; records keep arriving (in memory up to ``max_pending``, and in the journal);
- a record the database refuses (a string it cannot store, a value too wide): the batch is split in
  halves until the refused record stands alone; it is set aside in the dead-letter file with the
  reason and counted, and everyone else's records are written. One bad record never stops the rest.
Some refusals look like the first kind (PostgreSQL's program limits, a driver's I/O error on one
row are OperationalErrors): after ``_PROBE_AFTER`` failures in a row, each "unavailable" error is
checked by a probe write (``buffer.probe_write``). If the probe goes through, the database is up
and the batch is split as for a refusal (a lone record is tried once more, then set aside); if not,
it is down, and the batch waits.

Feedback naming an id still in flight waits for its batch instead of failing with "unknown id".
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, DisconnectionError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from services.common.buffer import insert_experiences, insert_missing_experiences, probe_write
from services.common.records import Experience
from services.explorer.recording.journal import Journal, Replayed, append_dead_letter, drop_dead_letters

log = logging.getLogger(__name__)

_REMEMBER_SET_ASIDE = 10_000  # ids of set-aside records kept to answer feedback about them
_PROBE_AFTER = 3  # failed writes of one batch in a row before each "unavailable" error is checked by a probe


class RecorderFull(RuntimeError):
    """Too many records wait for the database; new requests are refused until it recovers."""


class RecordsNotWritten(RuntimeError):
    """Records named by a request are still waiting for a database that is not taking writes."""

    def __init__(self, ids: Sequence[str], waited_s: float, last_error: str | None):
        self.ids = list(ids)
        super().__init__(
            f"{len(self.ids)} of the named experiences could not be written to the buffer within {waited_s:g}s"
            + (f" ({last_error})" if last_error else "") + "; they are safe in the journal, retry later"
        )


class RecordsSetAside(RuntimeError):
    """Records named by a request were refused by the buffer and set aside as dead letters."""

    def __init__(self, reasons: dict[str, str]):
        self.ids = list(reasons)
        first = next(iter(reasons.items()))
        super().__init__(
            f"experience(s) {', '.join(self.ids[:5])} could not be recorded and were set aside "
            f"(first reason: {first[1]})"
        )


def is_unavailable(exc: BaseException) -> bool:
    """True when the database cannot be reached or written right now (retry everything later),
    False when it refused this data (find the record and set it aside)."""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    return isinstance(exc, (OperationalError, InterfaceError, DisconnectionError, PoolTimeout, ConnectionError, TimeoutError))


# Errors about other writers, never about the data: a probe that slips in between two of them proves
# nothing, so they always mean "retry" (SQLite's lock and busy; PostgreSQL's deadlock, serialization
# failure, lock and statement timeouts).
_CONTENTION_SQLSTATES = {"40P01", "40001", "55P03", "57014"}
_CONTENTION_WORDS = ("database is locked", "database table is locked", "database is busy")


def is_contention(exc: BaseException) -> bool:
    orig = getattr(exc, "orig", exc)
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    if code in _CONTENTION_SQLSTATES:
        return True
    text = str(orig).lower()
    return any(w in text for w in _CONTENTION_WORDS)


@dataclass
class _Queued:
    record: Experience
    segment: int | None  # journal segment holding it
    since: float  # time.monotonic() when it was queued


@dataclass
class RecorderHealth:
    pending: int
    oldest_pending_s: float
    set_aside: int
    last_set_aside_s: float | None  # seconds since a record was last set aside
    last_error: str | None  # why the last write failed, while writes are failing
    journal_segments: int

    def problems(self, *, degraded_after_s: float, set_aside_window_s: float) -> list[str]:
        out = []
        if self.pending and self.oldest_pending_s > degraded_after_s:
            out.append(f"{self.pending} records have waited up to {self.oldest_pending_s:.1f}s for the buffer"
                       + (f" (last error: {self.last_error})" if self.last_error else ""))
        if self.last_set_aside_s is not None and self.last_set_aside_s < set_aside_window_s:
            out.append(f"{self.set_aside} records were set aside as dead letters, the last {self.last_set_aside_s:.0f}s ago")
        return out


class Recorder:
    def __init__(
        self,
        *,
        db: Engine,
        journal: Journal | None,
        dead_letters: Path,
        flush_interval_ms: float = 20.0,
        max_batch: int = 512,
        max_pending: int = 100_000,
        on_flush: Callable[[int, float], None] | None = None,
        on_set_aside: Callable[[Experience, str], None] | None = None,
        journal_max_age_s: float = 60.0,
        journal_adopt_s: float = 10.0,
    ):
        self._db = db
        self._journal = journal
        self.dead_letters = dead_letters
        self._interval = flush_interval_ms / 1000.0
        self._max_batch = max_batch
        self._max_pending = max_pending
        self._on_flush = on_flush
        self._on_set_aside = on_set_aside
        self._journal_max_age_s = journal_max_age_s
        self._journal_adopt_s = journal_adopt_s
        self._adopted_at = time.monotonic()
        self._pending: list[_Queued] = []
        self._keys: dict[str, int] = {}  # completion and experience ids not yet written
        self._set_aside: OrderedDict[str, tuple[str, str]] = OrderedDict()  # id -> (reason, agent)
        self._key_agent: dict[str, str] = {}  # the agent of each id in self._keys
        self._wakeup = asyncio.Event()
        self._flushed = asyncio.Condition()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._last_error: str | None = None
        self._last_set_aside: float | None = None
        self.written = 0
        self.failures = 0
        self._failing = 0  # failed writes of the current batch in a row
        self._writer = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"[:128]
        self.set_aside_count = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    def has_capacity(self, n: int = 1) -> bool:
        return len(self._pending) + n <= self._max_pending

    def health(self) -> RecorderHealth:
        now = time.monotonic()
        return RecorderHealth(
            pending=len(self._pending),
            oldest_pending_s=now - self._pending[0].since if self._pending else 0.0,
            set_aside=self.set_aside_count,
            last_set_aside_s=None if self._last_set_aside is None else now - self._last_set_aside,
            last_error=self._last_error,
            journal_segments=self._journal.segment_count if self._journal else 0,
        )

    # ------------------------------------------------------------------ start / stop

    async def start(self) -> None:
        if self._journal is not None:
            self._replay(await asyncio.to_thread(self._journal.open))
            self._adopted_at = time.monotonic()
        self._task = asyncio.create_task(self._run(), name="recorder")
        if self._pending:
            self._wakeup.set()

    def _replay(self, replayed: Replayed) -> None:
        now = time.monotonic()
        for record, segment in zip(replayed.records, replayed.segments):
            self._queue(_Queued(record, segment, now))

    async def _adopt(self) -> None:
        """Every ``journal_adopt_s``: write what a replica sharing the journal directory left behind."""
        if self._journal is None or time.monotonic() - self._adopted_at < self._journal_adopt_s:
            return
        self._adopted_at = time.monotonic()
        try:
            self._replay(await asyncio.to_thread(self._journal.adopt))
        except OSError as e:
            log.error("recorder: looking for segments to adopt in %s failed: %s", self._journal.dir, e)

    async def stop(self, timeout: float = 30.0) -> None:
        """Write everything still pending (for up to ``timeout``), then stop."""
        self._stopping = True
        self._wakeup.set()
        if self._task:
            try:
                await asyncio.wait_for(self._task, timeout)
            except asyncio.TimeoutError:
                pass  # wait_for cancelled the writer
        if self._pending:
            if self._journal is not None:
                log.error("recorder: %d records could not be written before shutdown (%s); they stay in the journal "
                          "%s and are written at the next start", len(self._pending), self._last_error, self._journal.dir)
            else:
                log.error("recorder: %d records could not be written before shutdown (%s) and are LOST: "
                          "recorder.journal is off", len(self._pending), self._last_error)
        if self._journal is not None:
            self._journal.close()

    # ------------------------------------------------------------------ the hot path

    def record(self, records: Sequence[Experience]) -> None:
        if not self.has_capacity(len(records)):
            raise RecorderFull(f"{len(self._pending)} records are waiting for the database")
        segment = self._journal.append(records) if self._journal is not None else None
        now = time.monotonic()
        for r in records:
            self._queue(_Queued(r, segment, now))
        self._wakeup.set()

    def _queue(self, q: _Queued) -> None:
        self._pending.append(q)
        for key in (q.record.experience_id, q.record.completion_id):
            self._keys[key] = self._keys.get(key, 0) + 1
            self._key_agent[key] = q.record.agent

    def in_flight(self, ids: Iterable[str]) -> bool:
        return any(i in self._keys for i in ids)

    def set_aside_reason(self, ids: Iterable[str]) -> dict[str, str]:
        """The ids (of those given) whose record was set aside, with the reason."""
        return {i: self._set_aside[i][0] for i in ids if i in self._set_aside}

    def _of_agents(self, ids: Sequence[str], agents: Sequence[str] | None) -> list[str]:
        """Those of ``ids`` that are not another agent's record (in flight or set aside) than ``agents``'."""
        if agents is None:
            return list(ids)
        allowed = set(agents)

        def agent_of(i: str) -> str | None:
            return self._key_agent.get(i) or (self._set_aside[i][1] if i in self._set_aside else None)

        return [i for i in ids if (a := agent_of(i)) is None or a in allowed]

    async def wait_written(self, ids: Sequence[str], timeout: float = 30.0, *, agents: Sequence[str] | None = None) -> None:
        """Return once none of ``ids`` is still waiting to be written. Raises RecordsNotWritten
        after ``timeout`` (the database is not taking writes) and RecordsSetAside when one of
        them was refused by the database. With ``agents`` (a key limited to them), another agent's
        records are neither waited for nor named: to that key they are ids that name nothing."""
        ids = self._of_agents(ids, agents)
        await self._wait_for(ids, timeout)
        if self._set_aside and (aside := self.set_aside_reason(ids)):
            raise RecordsSetAside(aside)

    def forget_user(self, user_id: str, agents: Sequence[str] | None = None) -> dict[str, Any]:
        """A user's data was deleted: seal the journal's open segment (it goes once its records are
        written; their rows were just deleted, and a replay skips them by their tombstones) and drop
        the user's dead letters. What it did, for the deletion's report."""
        rotated = self._journal.rotate() if self._journal is not None else False
        dropped = drop_dead_letters(self.dead_letters, user_id, agents)
        return {"journal_sealed": rotated, "dead_letters_dropped": dropped, "journal_max_age_s": self._journal_max_age_s}

    async def flush(self, timeout: float = 30.0) -> None:
        """Return once everything recorded before this call is written (read-your-writes)."""
        await self._wait_for([q.record.experience_id for q in self._pending], timeout)

    async def _wait_for(self, ids: Sequence[str], timeout: float) -> None:
        if not self.in_flight(ids):
            return
        self._wakeup.set()

        async def _wait():
            async with self._flushed:
                await self._flushed.wait_for(lambda: not self.in_flight(ids))

        try:
            await asyncio.wait_for(_wait(), timeout)
        except asyncio.TimeoutError:
            raise RecordsNotWritten([i for i in ids if i in self._keys], timeout, self._last_error) from None

    # ------------------------------------------------------------------ the writer

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            if self._journal is not None:  # the text of written records never waits in the journal past its age
                self._journal.seal_if_old(self._journal_max_age_s)
                if not self._stopping:
                    await self._adopt()
            if not self._pending:
                if self._stopping:
                    return
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), min(self._journal_max_age_s / 2, self._journal_adopt_s))
                except asyncio.TimeoutError:
                    continue
                # Let a few more records join the batch, unless it is full already.
                if len(self._pending) < self._max_batch and not self._stopping:
                    await asyncio.sleep(self._interval)
            batch = self._pending[: self._max_batch]
            if not batch:
                continue
            t0 = time.perf_counter()
            try:
                if self._journal is not None:
                    await asyncio.to_thread(self._journal.sync)
                set_aside = await asyncio.to_thread(self._write, [q.record for q in batch],
                                                    self._failing >= _PROBE_AFTER)
            except Exception as e:
                self.failures += 1
                self._failing += 1
                self._last_error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                log.error("recorder: writing %d records failed (%s); retrying in %.1fs", len(batch), self._last_error, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1
            self._failing = 0
            self._last_error = None
            self._done(batch, set_aside, time.perf_counter() - t0)
            async with self._flushed:
                self._flushed.notify_all()

    def _done(self, batch: list[_Queued], set_aside: dict[str, str], seconds: float) -> None:
        """Every record of ``batch`` is now written or set aside: forget it, free its journal space."""
        del self._pending[: len(batch)]
        segments: dict[int, int] = {}
        for q in batch:
            r = q.record
            for key in (r.experience_id, r.completion_id):
                left = self._keys.get(key, 0) - 1
                if left > 0:
                    self._keys[key] = left
                else:
                    self._keys.pop(key, None)
                    self._key_agent.pop(key, None)
            if q.segment is not None:
                segments[q.segment] = segments.get(q.segment, 0) + 1
            if r.experience_id in set_aside:
                self._remember_set_aside(r, set_aside[r.experience_id])
        for segment, n in segments.items():
            self._journal.release(segment, n)
        written = len(batch) - len(set_aside)
        self.written += written
        if self._on_flush and written:
            self._on_flush(written, seconds)

    def _remember_set_aside(self, record: Experience, reason: str) -> None:
        self.set_aside_count += 1
        self._last_set_aside = time.monotonic()
        for key in (record.experience_id, record.completion_id):
            self._set_aside[key] = (reason, record.agent)
        while len(self._set_aside) > _REMEMBER_SET_ASIDE:
            self._set_aside.popitem(last=False)
        if self._on_set_aside:
            self._on_set_aside(record, reason)

    # ------------------------------------------------------------------ in a worker thread

    def _write(self, batch: list[Experience], probing: bool = False) -> dict[str, str]:
        """Write ``batch``, isolating records the database refuses: returns {experience_id: reason}
        of those set aside. Raises when the database is unavailable (nothing is lost: the rows
        written so far are skipped on the retry). ``probing``: an "unavailable" error counts as a
        refusal while a probe write goes through."""
        try:
            self._insert(batch)
            return {}
        except Exception as e:
            if is_unavailable(e) and (is_contention(e) or not (probing and self._takes_writes())):
                raise
            if len(batch) == 1 and is_unavailable(e):  # up, yet not this row: once more before setting it aside
                try:
                    self._insert(batch)
                    return {}
                except Exception as again:
                    if is_unavailable(again) and (is_contention(again) or not self._takes_writes()):
                        raise
                    e = again
            if len(batch) == 1:
                reason = f"{type(e).__name__}: {str(e).splitlines()[0][:500] if str(e) else ''}"
                path = append_dead_letter(self.dead_letters, batch[0], reason)
                log.error("recorder: the buffer refused experience %s (%s); set aside in %s",
                          batch[0].experience_id, reason, path)
                return {batch[0].experience_id: reason}
        mid = len(batch) // 2
        return {**self._write(batch[:mid], probing), **self._write(batch[mid:], probing)}

    def _takes_writes(self) -> bool:
        """The probe: does the database take a small write now?"""
        try:
            probe_write(engine=self._db, writer=self._writer)
            return True
        except Exception as e:
            log.warning("recorder: the database takes no writes (%s: %s)", type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
            return False

    def _insert(self, batch: list[Experience]) -> None:
        try:
            insert_experiences(engine=self._db, records=batch)
        except IntegrityError:
            # A previous attempt (or a replayed journal) may have committed some of these already.
            insert_missing_experiences(engine=self._db, records=batch)
