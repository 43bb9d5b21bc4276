"""Back-pressure: while an agent's Trainer is far behind (more committed experiences waiting than
``backpressure.max_backlog``), the Explorer either refuses its chats with 429 (``reject``) or answers
them without recording (``unrecorded``): recording traffic that can only wait or go stale helps no
one. The backlog is counted every ``check_interval_s``; ``/metrics`` shows it
(``kaizen_backlog``, counted up to max_backlog + 1) and which agents are under back-pressure (``kaizen_backpressure``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from sqlalchemy.engine import Engine

from services.common import buffer
from services.explorer.config import BackpressureSection
from services.explorer.edge.metrics import ExplorerMetrics

log = logging.getLogger(__name__)


class Backpressure:
    def __init__(self, cfg: BackpressureSection, *, db: Engine, metrics: ExplorerMetrics, agents: Callable[[], list[str]]):
        self.cfg = cfg
        self._agents = agents
        self._db = db
        self._metrics = metrics
        self.active: set[str] = set()

    @property
    def enabled(self) -> bool:
        return self.cfg.max_backlog is not None

    def check(self) -> None:
        """Count the backlog now (a worker thread's call)."""
        # Counted up to one past the limit: enough to decide, at a bounded cost however long the backlog.
        backlog = buffer.committed_backlog(engine=self._db, agents=self._agents(), cap=self.cfg.max_backlog + 1)
        active = {agent for agent, n in backlog.items() if n > self.cfg.max_backlog}
        for agent in active - self.active:
            log.warning("agent %s: %d committed experiences wait for the Trainer (backpressure.max_backlog %d): "
                        "its chats are %s until it catches up", agent, backlog[agent], self.cfg.max_backlog,
                        "refused with 429" if self.cfg.mode == "reject" else "answered without recording")
        for agent in self.active - active:
            log.info("agent %s: the Trainer caught up (%d waiting); back-pressure lifted", agent, backlog.get(agent, 0))
        for agent in set(backlog) | self.active:
            self._metrics.backlog.labels(agent).set(backlog.get(agent, 0))
            self._metrics.backpressure.labels(agent, self.cfg.mode).set(1 if agent in active else 0)
        self.active = active

    async def run(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.check)
            except Exception as e:  # the buffer may be down: keep the last view
                log.warning("back-pressure: counting the backlog failed (%s)", type(e).__name__)
            await asyncio.sleep(self.cfg.check_interval_s)
