"""Episode pinning: every call of one episode is served by the version its first call used.

A multi-turn episode (every call under one ``task_id`` + ``run_id``) that switched versions halfway
would mix two policies in one trajectory, and its reward could not be credited to either. So the
first call's version is remembered, and later calls of the episode lease that version (loading it
again if it was let go) even after a newer one became current. An episode is forgotten
``reload.episode_pin_s`` after its first call (so a task_id + run_id that a client reuses forever
still moves on to new versions), or when too many are remembered; while remembered, its version
counts as in use in the serving files, so the Trainer keeps its folder.

With the buffer's database (``reload.episode_pins: database``, the default on PostgreSQL; ``process``
pins per replica, the default on SQLite) the first call's version is also recorded there (``buffer.pins``), so that the episode's next
call gets it whichever replica serves it: a call of an episode this replica has not seen looks its pin
up before it takes a version (one read) and serves the version found; with none found it serves the
current version and claims the episode for it off the request's path (``claim_later``: no write
between taking a version and recording the call, so calls are recorded in the order their versions
went live). Two replicas serving an episode's first calls at the same moment agree afterwards on the
one the database recorded first. While the database does not answer, each replica pins what it has
seen itself (for 30 s at a time).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections import Counter, OrderedDict
from typing import Callable

from sqlalchemy.exc import SQLAlchemyError

from services.common import buffer

log = logging.getLogger(__name__)

MAX_PENDING_CLAIMS = 1000  # claims waiting for the database at once; beyond, new episodes pin in this replica alone


class EpisodePins:
    def __init__(self, *, ttl_s: float, max_episodes: int, on_change: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, db=None):
        self.ttl_s = ttl_s
        self._db = db  # the buffer's engine: pins shared with every replica on it (None: this process alone)
        self.retry_s = 30.0
        self._local_until = 0.0  # monotonic: pin in this replica alone until then (the database failed)
        self._calls = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="episode-pins")
        # claims run on threads of their own: a slow database never queues a request's lookup behind them
        self._claiming = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="episode-pins-claim")
        self._forgotten: OrderedDict[tuple[str, int], None] = OrderedDict()  # versions whose pins were dropped lately
        self._background = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="episode-pins-forget")
        self.max_episodes = max_episodes
        self._on_change = on_change
        self._clock = clock
        self._pins: OrderedDict[tuple[str, str, str], tuple[int, float]] = OrderedDict()  # key -> (version, first call)
        self._held: Counter[tuple[str, int]] = Counter()
        self.misses = 0  # a pinned version that could not be served any more (deleted): the episode moved on
        self._claims: set[asyncio.Task] = set()  # claims running off the requests' path (claim_later)
        self.claims_skipped = 0  # new episodes not claimed in the database: MAX_PENDING_CLAIMS were waiting

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    def get(self, agent: str, task_id: str, run_id: str) -> int | None:
        self._expire()
        pin = self._pins.get((agent, task_id, run_id))
        return None if pin is None else pin[0]

    def remember(self, agent: str, task_id: str, run_id: str, version: int, first_at: float | None = None) -> None:
        """The episode is on ``version``; ``first_at``: when its first call was (wall clock, as the
        database keeps it; None: now), so that a pin learned from another replica lapses when its own does."""
        key = (agent, task_id, run_id)
        old = self._pins.get(key)
        if old is not None and old[0] == version:
            return
        self._pins.pop(key, None)
        first = self._clock() - (0.0 if first_at is None else max(0.0, time.time() - first_at))
        self._pins[key] = (version, first)  # a new episode, or one that moved on: its clock restarts
        if old is not None:
            self._unhold(agent, old[0])
        self._held[(agent, version)] += 1
        while len(self._pins) > self.max_episodes:
            (a, _, _), (v, _) = self._pins.popitem(last=False)
            self._unhold(a, v)
        if self._on_change:
            self._on_change()

    def forget(self, agent: str, task_id: str, run_id: str) -> None:
        pin = self._pins.pop((agent, task_id, run_id), None)
        if pin is not None:
            self._unhold(agent, pin[0])

    def forget_version(self, agent: str, version: int) -> int:
        """Forget every episode pinned to ``version`` (it was rejected or rolled back: safety comes
        before keeping an episode on one version), here and, on a background thread, in the database;
        returns how many this replica had."""
        self._forgotten[(agent, version)] = None
        while len(self._forgotten) > 1000:
            self._forgotten.popitem(last=False)
        doomed = [key for key, (v, _) in self._pins.items() if key[0] == agent and v == version]
        for key in doomed:
            self.forget(*key)
        if self._db is not None:
            self._background.submit(self._forget_shared, agent, version)
        return len(doomed)

    def _forget_shared(self, agent: str, version: int, attempts: int = 5) -> None:
        for attempt in range(attempts):
            try:
                buffer.pins.forget_version(engine=self._db, agent=agent, version=version)
                return
            except SQLAlchemyError as e:
                if attempt == attempts - 1:
                    log.error("episode pins: could not drop the database's pins to %s v%d (%s); they lapse after "
                              "reload.episode_pin_s", agent, version, type(e).__name__)
                else:
                    time.sleep(2.0 ** attempt)

    def held(self, agent: str) -> set[int]:
        """Versions of ``agent`` some remembered episode may still ask for."""
        self._expire()
        return {v for (a, v), n in self._held.items() if a == agent and n > 0}

    def __len__(self) -> int:
        return len(self._pins)

    def _unhold(self, agent: str, version: int) -> None:
        self._held[(agent, version)] -= 1
        if self._held[(agent, version)] <= 0:
            del self._held[(agent, version)]

    def _expire(self) -> None:
        cutoff = self._clock() - self.ttl_s
        while self._pins:
            key, (version, first) = next(iter(self._pins.items()))
            if first >= cutoff:
                return
            del self._pins[key]
            self._unhold(key[0], version)

    # ------------------------------------------------------------------ shared with other replicas

    async def _shared(self, what: str, fn, default, *, executor=None, **kw):
        """``fn(engine=db, **kw)`` on the pins' own threads; ``default`` without a database, or while it
        fails (left alone for ``retry_s`` after a failure, logged once per outage)."""
        if self._db is None or time.monotonic() < self._local_until:
            return default
        try:
            return await asyncio.get_running_loop().run_in_executor(executor or self._calls,
                                                                     lambda: fn(engine=self._db, **kw))
        except SQLAlchemyError as e:
            if time.monotonic() >= self._local_until:
                log.warning("episode pins: the database did not answer (%s: %s); pinning in this replica alone for "
                            "%.0f s", what, type(e).__name__, self.retry_s)
            self._local_until = time.monotonic() + self.retry_s
            return default

    @property
    def shared(self) -> bool:
        return self._db is not None

    async def find(self, agent: str, task_id: str, run_id: str) -> tuple[int, float] | None:
        """The version another replica recorded for the episode and its first call's time, or None."""
        return await self._shared("find", buffer.pins.find, None, agent=agent, task_id=task_id, run_id=run_id,
                                  now=time.time(), ttl_s=self.ttl_s)

    def claim_later(self, agent: str, task_id: str, run_id: str, version: int) -> None:
        """``claim`` off the request's path: the call is served with ``version`` at once; should another
        replica have recorded a different version first (their first calls at the same moment), this
        replica adopts that one for the episode's next calls."""
        if self._db is None or (agent, version) in self._forgotten:
            return
        if len(self._claims) >= MAX_PENDING_CLAIMS:  # the database is far behind: this episode pins here alone
            self.claims_skipped += 1
            return

        def adopt(task: asyncio.Task) -> None:
            if task.cancelled() or task.exception() is not None:
                return
            if (agent, version) in self._forgotten:  # dropped while this claim waited: drop its pin again
                with contextlib.suppress(RuntimeError):  # closed meanwhile
                    self._background.submit(self._forget_shared, agent, version)
                return
            pinned, first_at = task.result()
            if pinned != version and self.get(agent, task_id, run_id) == version:
                self.remember(agent, task_id, run_id, pinned, first_at)

        task = asyncio.get_running_loop().create_task(self._shared(
            "claim", buffer.pins.claim, (version, None), executor=self._claiming, agent=agent, task_id=task_id,
            run_id=run_id, version=version, now=time.time(), ttl_s=self.ttl_s))
        self._claims.add(task)
        task.add_done_callback(self._claims.discard)
        task.add_done_callback(adopt)

    async def claim(self, agent: str, task_id: str, run_id: str, version: int) -> tuple[int, float | None]:
        """Record ``version`` as the episode's for every replica, unless one recorded another first:
        (the version the episode is pinned to, its first call's wall-clock time; None: this call)."""
        return await self._shared("claim", buffer.pins.claim, (version, None), agent=agent, task_id=task_id,
                                  run_id=run_id, version=version, now=time.time(), ttl_s=self.ttl_s)

    async def moved(self, agent: str, task_id: str, run_id: str, version: int) -> None:
        """The episode's version was gone: it goes on with ``version``, for every replica."""
        await self._shared("move", buffer.pins.move, None, agent=agent, task_id=task_id, run_id=run_id,
                           version=version, now=time.time())

    def close(self) -> None:
        """Let the database's work already handed over finish."""
        self._calls.shutdown(wait=True)
        self._claiming.shutdown(wait=True)
        self._background.shutdown(wait=True)
