"""Agent-by-agent training (``trainer.schedule.mode: round_robin``, MARFT's agent iteration).

One agent trains for ``interval`` steps while its teammates stay frozen (their versions do not
move), then the next one in ``order``. The turn is not stored anywhere: it follows from the
trainer steps the buffer records (newest first), so a restarted Trainer goes on where it stopped.
Pure logic; the service feeds it ``buffer.recent_trainer_steps``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Sequence


@dataclass(frozen=True)
class Turn:
    agent: str  # the agent that trains now
    steps_done: int  # steps it already made in this turn
    started_at: datetime | None  # when the turn began: the previous agent's last step (None: the first turn)


def current_turn(recent: Sequence[tuple[str, datetime]], order: Sequence[str], interval: int) -> Turn:
    """The turn after the trainer steps ``recent`` ((agent, time), newest first; steps of agents
    outside ``order`` are ignored). An agent whose run of steps is shorter than ``interval`` keeps the
    turn; after ``interval`` steps it passes to the next agent in ``order``."""
    if not order:
        raise ValueError("a round-robin schedule needs at least one agent")
    steps = [(a, t) for a, t in recent if a in order]
    if not steps:
        return Turn(order[0], 0, None)
    last = steps[0][0]
    run = next((k for k, (a, _) in enumerate(steps) if a != last), len(steps))
    if run < interval:
        return Turn(last, run, steps[run][1] if run < len(steps) else None)
    return Turn(order[(order.index(last) + 1) % len(order)], 0, steps[0][1])


def next_agent(order: Sequence[str], agent: str) -> str:
    return order[(order.index(agent) + 1) % len(order)]
