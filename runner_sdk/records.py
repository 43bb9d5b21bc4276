"""The SDK's records: a mark, one run of the agent on one request, and the runner's counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Mark:
    """What ``with mark(...)`` put in the context: its labels, metadata and when it was entered."""

    labels: tuple[str, ...]
    metadata: dict[str, Any]
    created: float  # time.monotonic(), for ExplicitMarking's ttl


@dataclass
class AgentRun:
    """One run of the agent: what it was asked, what it answered, which Explorer calls it made."""

    task_id: str
    run_id: str
    input: Any = None
    expected: Any = None
    output: Any = None
    labels: tuple[str, ...] = ()
    metadata: dict[str, Any] = field(default_factory=dict)
    selected: bool = False
    explore: bool = False  # a run nobody reads (shadow): the Explorer may sample it at the agent's exploration temperature
    msg_ids: list[str] = field(default_factory=list)  # chat completion ids the Explorer returned
    reward: float | None = None
    hint: str | None = None  # feedback in words from the reward calculator (a Verdict's hint)
    error: str | None = None


@dataclass
class RunnerStats:
    requests: int = 0
    selected: int = 0
    runs: int = 0
    shadow_runs: int = 0
    shadow_failures: int = 0
    shadow_dropped: int = 0
    reward_errors: int = 0
    feedback_sent: int = 0
    feedback_failed_attempts: int = 0
    feedback_dropped: int = 0
    commits: int = 0
    committed: int = 0
    commit_failures: int = 0
