"""Kaizen runner SDK: the thin client inside an agent application (httpx + pydantic, no torch).

It selects which requests become training data, computes rewards, and sends feedback and commits
to the Kaizen Explorer. See docs/SDK.md for a ten-line example of each mode.
"""

from runner_sdk.client import (
    AgentClient,
    ExplorerClient,
    ExplorerError,
    SyncExplorerClient,
    tracked_async_http_client,
    tracked_http_client,
)
from runner_sdk.groups import AdaptiveRepeat
from runner_sdk.environment import Environment, EnvironmentRunner, EpisodeResult
from runner_sdk.records import AgentRun, RunnerStats
from runner_sdk.rewards import ExactMatch, FunctionReward, LLMJudge, RegexMatch, RewardCalculator, Verdict
from runner_sdk.runner import TrainingRunner
from runner_sdk.selection import Decision, ExplicitMarking, RequestInfo, SamplingRate, SelectionStrategy, mark
from runner_sdk.threads import ContextThread, ContextThreadPoolExecutor, carry_context

__all__ = [
    "AdaptiveRepeat",
    "AgentClient",
    "AgentRun",
    "ContextThread",
    "ContextThreadPoolExecutor",
    "Decision",
    "Environment",
    "EnvironmentRunner",
    "EpisodeResult",
    "ExactMatch",
    "ExplicitMarking",
    "ExplorerClient",
    "ExplorerError",
    "FunctionReward",
    "LLMJudge",
    "RegexMatch",
    "RequestInfo",
    "RewardCalculator",
    "RunnerStats",
    "SamplingRate",
    "SelectionStrategy",
    "SyncExplorerClient",
    "TrainingRunner",
    "Verdict",
    "carry_context",
    "mark",
    "tracked_async_http_client",
    "tracked_http_client",
]
