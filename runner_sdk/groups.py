"""How many runs a task gets, decided as its rewards come in (``AdaptiveRepeat``).

A GRPO group teaches only where its runs disagree. Late in a loop most tasks are solved by every run, and
their groups are set aside as flat: the samples spent on them bought nothing. So a task first gets ``first``
runs; one whose runs disagree is completed to ``full`` (the group GRPO trains on); one all of whose runs
failed is completed to ``full`` too and, if every run still failed, to ``failed`` (more tries where the agent
rarely succeeds, the only way a success, and so a signal, turns up there); one all of whose runs succeeded
stops at ``first``.

    repeat = AdaptiveRepeat(first=4, full=8, failed=16)
    repeat.more([1, 1, 1, 1])      # 0: solved by every run
    repeat.more([1, 0, 1, 1])      # 4: completed to 8
    repeat.more([0] * 8)           # 8: every run failed, to 16
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class AdaptiveRepeat:
    first: int  # runs every task gets
    full: int  # a task whose runs disagree (or all failed) is completed to this many
    failed: int | None = None  # a task whose runs all failed at ``full`` goes on to this many (None: ``full``)
    solved: float = 1.0  # a run with a reward at or above this succeeded

    def __post_init__(self):
        if self.first < 1:
            raise ValueError(f"AdaptiveRepeat: first must be at least 1 (got {self.first})")
        if self.full < self.first:
            raise ValueError(f"AdaptiveRepeat: full ({self.full}) must be at least first ({self.first})")
        if self.failed is not None and self.failed < self.full:
            raise ValueError(f"AdaptiveRepeat: failed ({self.failed}) must be at least full ({self.full})")

    @classmethod
    def fixed(cls, n: int) -> AdaptiveRepeat:
        """Every task ``n`` runs, whatever they score (the plain ``repeat=n``)."""
        if n < 1:
            raise ValueError(f"repeat must be at least 1 (got {n})")
        return cls(first=n, full=n)

    def more(self, rewards: list[float]) -> int:
        """How many more runs a task needs, given the rewards of the runs it had (its first ``first``, then
        each stage's): 0 once it is done."""
        n = len(rewards)
        if n < self.first:
            return self.first - n
        if min(rewards) >= self.solved:
            return 0  # every run succeeded: a flat group, nothing more to learn from it
        if max(rewards) != min(rewards):
            return max(0, self.full - n)  # the runs disagree: a group with signal, completed
        # every run scored alike below success: more tries, to full and then to failed
        for target in (self.full, self.failed or self.full):
            if n < target:
                return target - n
        return 0


async def run_group(repeat: AdaptiveRepeat, run: Callable[[int], Awaitable[T]], *, reward: Callable[[T], float],
                    failed: Callable[[T], bool]) -> list[T]:
    """One task's runs, ``run(i)`` for run ids 0, 1, ..., stage by stage as ``repeat`` asks for more (each stage's
    runs at once). A stage with a run that ``failed`` (an error, not a low reward) is the last: no run is retried."""
    runs: list[T] = []
    more = repeat.first
    while more:
        stage = await asyncio.gather(*(run(len(runs) + i) for i in range(more)))
        runs += stage
        more = 0 if any(failed(r) for r in stage) else repeat.more([reward(r) for r in runs])
    return runs
