"""The runner's one way to the Explorer's /feedback and /commit: a bounded queue and its sender.

Direct runs, shadow runs and ``TrainingRunner.queue_feedback`` all ``put`` here, from any thread.
The sender runs on the runner's event loop: it posts the oldest entry first, retries with backoff
while the Explorer is down or busy, drops what the Explorer refuses, and keeps at most
``max_pending`` entries (the oldest go first). Commits name the ids whose feedback went through, in
chunks, so a runner commits its own work and never other runners' or other agents' rewarded rows.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import httpx

from runner_sdk.client import ExplorerClient, ExplorerError
from runner_sdk.records import RunnerStats

log = logging.getLogger("runner_sdk")

HINT_MAX_CHARS = 4_000  # the longest hint the Explorer takes (services/common/hints.py)
COMMIT_CHUNK = 1_000  # ids per POST /commit; the Explorer takes up to 10,000, smaller bodies retry cheaper


def chunks(ids: Sequence[str], size: int = COMMIT_CHUNK) -> Iterator[list[str]]:
    for start in range(0, len(ids), size):
        yield list(ids[start:start + size])


@dataclass(frozen=True)
class Feedback:
    """One POST /feedback body."""

    msg_ids: tuple[str, ...]
    reward: float | None
    task_id: str | None = None
    run_id: str | None = None
    labels: tuple[str, ...] = ()
    comment: str | None = None
    source: str = "runner_sdk"
    expected: Any = None  # what the run was expected to produce (kept for the release gate's replay)
    hint: str | None = None  # feedback in words: what should have been done
    correction: dict[str, Any] | None = None  # the assistant message the one call of msg_ids should have answered
    # every retry of this body goes under this key: the Explorer applies it once (a timed-out attempt it took)
    key: str = field(default_factory=lambda: uuid.uuid4().hex)


class FeedbackQueue:
    def __init__(self, *, stats: RunnerStats, lock: threading.Lock, max_pending: int, retry_initial: float,
                 retry_max: float):
        self.stats = stats
        self._lock = lock  # guards ``stats``, which the application's threads read and write too
        self.max_pending = max_pending
        self.retry_initial = retry_initial
        self.retry_max = retry_max
        self._pending: collections.deque[Feedback] = collections.deque()
        # ids whose feedback the Explorer took and that are not committed yet; a dict keeps them in
        # delivery order without duplicates
        self._delivered: dict[str, None] = {}
        self._explorer: ExplorerClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._drained: asyncio.Event | None = None
        self._commit_lock: asyncio.Lock | None = None
        self._tasks: list[asyncio.Task] = []

    def __len__(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------------ any thread

    def put(self, feedback: Feedback) -> None:
        """Queue one feedback; it is sent from the runner's loop (or kept until it starts)."""
        loop = self._loop
        if loop is not None:
            try:
                on_loop = asyncio.get_running_loop() is loop
            except RuntimeError:
                on_loop = False
            if not on_loop:
                try:
                    loop.call_soon_threadsafe(self._append, feedback)
                    return
                except RuntimeError:  # the loop closed meanwhile: keep it for the next start
                    pass
        self._append(feedback)

    def _append(self, feedback: Feedback) -> None:
        if len(self._pending) >= self.max_pending:
            self._pending.popleft()
            with self._lock:
                self.stats.feedback_dropped += 1
        self._pending.append(feedback)
        if self._wake is not None:
            self._drained.clear()
            self._wake.set()

    # ------------------------------------------------------------------ the runner's loop

    def start(self, explorer: ExplorerClient, *, commit_interval: float) -> None:
        """Start sending (and committing every ``commit_interval`` s, if > 0); call on the runner's loop."""
        self._explorer = explorer
        self._loop = asyncio.get_running_loop()
        self._wake, self._drained, self._commit_lock = asyncio.Event(), asyncio.Event(), asyncio.Lock()
        if self._pending:  # put before start
            self._wake.set()
        else:
            self._drained.set()
        self._tasks = [asyncio.create_task(self._deliver_forever())]
        if commit_interval > 0:
            self._tasks.append(asyncio.create_task(self._commit_forever(commit_interval)))

    async def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for every queued feedback to be sent or refused; True if none is left."""
        try:
            await asyncio.wait_for(self._drained.wait(), max(0.0, timeout))
        except asyncio.TimeoutError:
            pass
        return not self._pending

    async def close(self, budget: float) -> None:
        """Send what is queued (up to ``budget`` s), drop the rest, stop, and commit what went through."""
        if not await self.flush(budget):
            log.warning("runner stopped with %d feedback messages undelivered", len(self._pending))
            with self._lock:
                self.stats.feedback_dropped += len(self._pending)
            self._pending.clear()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self.commit()
        self._loop = self._wake = self._drained = None

    async def _deliver_forever(self) -> None:
        backoff = self.retry_initial
        while True:
            if not self._pending:
                self._drained.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            fb = self._pending[0]
            try:
                await self._explorer.feedback(msg_ids=list(fb.msg_ids), reward=fb.reward, task_id=fb.task_id,
                                              run_id=fb.run_id, labels=list(fb.labels) or None, comment=fb.comment,
                                              source=fb.source, expected=fb.expected, hint=fb.hint, correction=fb.correction,
                                              idempotency_key=fb.key)
            except (httpx.HTTPError, ExplorerError) as e:
                if isinstance(e, ExplorerError) and not e.retryable:
                    log.warning("feedback refused, dropping it: %s", e)
                    self._drop(fb)
                    continue
                with self._lock:
                    self.stats.feedback_failed_attempts += 1
                log.debug("feedback failed (%s), retrying in %.1fs", e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.retry_max)
                continue
            except Exception:  # a bad entry must not stop the sender for everyone behind it
                log.exception("feedback could not be sent, dropping it")
                self._drop(fb)
                continue
            backoff = self.retry_initial
            if self._pending and self._pending[0] is fb:  # unless dropped for room while in flight
                self._pending.popleft()
            self._delivered.update(dict.fromkeys(fb.msg_ids))
            with self._lock:
                self.stats.feedback_sent += 1

    def _drop(self, fb: Feedback) -> None:
        if self._pending and self._pending[0] is fb:
            self._pending.popleft()
        with self._lock:
            self.stats.feedback_dropped += 1

    async def _commit_forever(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.commit()

    async def commit(self) -> int:
        """Commit the ids whose feedback went through, in chunks; returns how many experiences committed.

        Nothing to commit sends nothing. A chunk the Explorer cannot take now stays for the next
        commit; one it refuses (4xx) is dropped, since sending it again would be refused again.
        """
        async with self._commit_lock:  # the interval and commit_now must not send the same ids twice
            committed = 0
            for chunk in chunks(list(self._delivered)):
                try:
                    result = await self._explorer.commit(msg_ids=chunk)
                except (httpx.HTTPError, ExplorerError) as e:
                    with self._lock:
                        self.stats.commit_failures += 1
                    if isinstance(e, ExplorerError) and not e.retryable:
                        log.warning("commit of %d ids refused, dropping them: %s", len(chunk), e)
                        self._forget(chunk)
                        continue
                    log.warning("commit failed, will retry: %s", e)
                    break
                self._forget(chunk)
                n = int(result.get("committed", 0))
                committed += n
                with self._lock:
                    self.stats.commits += 1
                    self.stats.committed += n
            return committed

    def _forget(self, ids: list[str]) -> None:
        for i in ids:
            self._delivered.pop(i, None)
