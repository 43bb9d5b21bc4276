"""Writes experiences to the buffer in small batches, off the request's hot path.

A chat request hands its records over and returns at once. A background task writes whatever is
pending every ``flush_interval_ms`` (or as soon as ``max_batch`` records wait) in one transaction.
If the database is unreachable the records stay in memory (up to ``max_pending``) and are retried
with backoff: nothing accepted is dropped silently. Feedback naming an id still in flight waits
for its batch instead of failing with "unknown id".
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Iterable, Sequence

from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from services.common.buffer import experiences, insert_experiences
from services.common.records import Experience

log = logging.getLogger(__name__)


class RecorderFull(RuntimeError):
    """Too many records wait for the database; new requests are refused until it recovers."""


class Recorder:
    def __init__(
        self,
        *,
        db: Engine,
        flush_interval_ms: float = 20.0,
        max_batch: int = 512,
        max_pending: int = 100_000,
        on_flush: Callable[[int, float], None] | None = None,
    ):
        self._db = db
        self._interval = flush_interval_ms / 1000.0
        self._max_batch = max_batch
        self._max_pending = max_pending
        self._on_flush = on_flush
        self._pending: list[Experience] = []
        self._keys: dict[str, int] = {}  # completion and experience ids not yet written
        self._wakeup = asyncio.Event()
        self._flushed = asyncio.Condition()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.written = 0
        self.failures = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    def has_capacity(self, n: int = 1) -> bool:
        return len(self._pending) + n <= self._max_pending

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="recorder")

    async def stop(self, timeout: float = 30.0) -> None:
        """Write everything still pending, then stop."""
        self._stopping = True
        self._wakeup.set()
        if self._task:
            try:
                await asyncio.wait_for(self._task, timeout)
            except asyncio.TimeoutError:
                log.error("recorder: %d records could not be written before shutdown", len(self._pending))
                self._task.cancel()

    def record(self, records: Sequence[Experience]) -> None:
        if not self.has_capacity(len(records)):
            raise RecorderFull(f"{len(self._pending)} records are waiting for the database")
        for r in records:
            self._pending.append(r)
            for key in (r.experience_id, r.completion_id):
                self._keys[key] = self._keys.get(key, 0) + 1
        self._wakeup.set()

    def in_flight(self, ids: Iterable[str]) -> bool:
        return any(i in self._keys for i in ids)

    async def wait_written(self, ids: Sequence[str], timeout: float = 30.0) -> None:
        """Return once none of ``ids`` is still waiting to be written."""
        if not self.in_flight(ids):
            return
        self._wakeup.set()

        async def _wait():
            async with self._flushed:
                await self._flushed.wait_for(lambda: not self.in_flight(ids))

        await asyncio.wait_for(_wait(), timeout)

    async def flush(self, timeout: float = 30.0) -> None:
        """Return once everything recorded before this call is written (read-your-writes)."""
        await self.wait_written([r.experience_id for r in self._pending], timeout)

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            if not self._pending:
                if self._stopping:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                # Let a few more records join the batch, unless it is full already.
                if len(self._pending) < self._max_batch and not self._stopping:
                    await asyncio.sleep(self._interval)
            batch = self._pending[: self._max_batch]
            if not batch:
                continue
            t0 = time.perf_counter()
            try:
                await asyncio.to_thread(self._write, batch)
            except Exception as e:
                self.failures += 1
                log.error("recorder: writing %d records failed (%s); retrying in %.1fs", len(batch), e, backoff)
                if self._stopping and backoff > 5:
                    return
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            backoff = 0.1
            del self._pending[: len(batch)]
            for r in batch:
                for key in (r.experience_id, r.completion_id):
                    left = self._keys.get(key, 0) - 1
                    if left > 0:
                        self._keys[key] = left
                    else:
                        self._keys.pop(key, None)
            self.written += len(batch)
            if self._on_flush:
                self._on_flush(len(batch), time.perf_counter() - t0)
            async with self._flushed:
                self._flushed.notify_all()

    def _write(self, batch: list[Experience]) -> None:
        try:
            insert_experiences(engine=self._db, records=batch)
        except IntegrityError:
            # A previous attempt may have committed before its acknowledgement was lost:
            # write only the rows that are not there yet.
            ids = [r.experience_id for r in batch]
            with self._db.connect() as conn:
                have = set(conn.scalars(select(experiences.c.experience_id).where(experiences.c.experience_id.in_(ids))))
            insert_experiences(engine=self._db, records=[r for r in batch if r.experience_id not in have])
