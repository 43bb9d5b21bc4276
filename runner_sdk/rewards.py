"""Reward calculators: from a finished agent run to a float (usually in [0, 1]).

Any callable ``run -> float`` (or ``-> Awaitable[float]``) is a RewardCalculator; one may return a
``Verdict`` instead, to add a hint in words (or give a hint alone). Built in:
``ExactMatch`` and ``RegexMatch`` against the run's expected answer, ``FunctionReward`` over the
final message, and ``LLMJudge``, which asks an OpenAI-compatible endpoint to grade with a rubric.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol, runtime_checkable

import httpx

from runner_sdk.records import AgentRun


@dataclass(frozen=True)
class Verdict:
    """What a reward calculator may return instead of a float: a reward, a hint in words (what the
    agent should have done; it learns it by self-distillation), or both."""

    reward: float | None = None
    hint: str | None = None

    def __post_init__(self) -> None:
        if self.hint is not None and not self.hint.strip():
            object.__setattr__(self, "hint", None)  # a blank hint says nothing: the reward alone
        if self.reward is None and self.hint is None:
            raise ValueError("a Verdict needs a reward or a non-empty hint")


@runtime_checkable
class RewardCalculator(Protocol):
    def __call__(self, run: AgentRun) -> float | Verdict | Awaitable[float | Verdict]: ...


def _text(value: Any) -> str:
    return "" if value is None else str(value)


class ExactMatch:
    """1.0 when the output equals the expected answer (by default ignoring case and outer space)."""

    def __init__(self, *, normalize: bool = True):
        self.normalize = normalize

    def _norm(self, s: str) -> str:
        return " ".join(s.split()).casefold() if self.normalize else s

    def __call__(self, run: AgentRun) -> float:
        if run.expected is None:
            raise ValueError("ExactMatch needs the run's expected answer")
        return 1.0 if self._norm(_text(run.output)) == self._norm(_text(run.expected)) else 0.0


class RegexMatch:
    """1.0 when ``pattern`` matches the output. ``{expected}`` in the pattern is the escaped expected answer."""

    def __init__(self, pattern: str = r"\b{expected}\b", *, flags: int = re.IGNORECASE):
        self.pattern = pattern
        self.flags = flags

    def __call__(self, run: AgentRun) -> float:
        pattern = self.pattern
        if "{expected}" in pattern:
            if run.expected is None:
                raise ValueError("this RegexMatch pattern needs the run's expected answer")
            pattern = pattern.replace("{expected}", re.escape(_text(run.expected)))
        return 1.0 if re.search(pattern, _text(run.output), self.flags) else 0.0


class FunctionReward:
    """Any Python function of the final message: ``FunctionReward(lambda text: float(len(text) < 200))``."""

    def __init__(self, fn: Callable[[str], float | Awaitable[float]]):
        self.fn = fn

    def __call__(self, run: AgentRun) -> float | Awaitable[float]:
        return self.fn(_text(run.output))


_SCORE = re.compile(r"(-?\d+(?:\.\d+)?)")

DEFAULT_RUBRIC = (
    "You grade an AI agent's answer. Reply with a single number from 0 to 10 and nothing else: "
    "10 means fully correct and helpful, 0 means wrong or useless."
)


class LLMJudge:
    """Ask an OpenAI-compatible chat endpoint for a score; returns it scaled to [0, 1]."""

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        rubric: str = DEFAULT_RUBRIC,
        api_key: str | None = None,
        scale: float = 10.0,
        timeout: float = 60.0,
        temperature: float = 0.0,
    ):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.rubric = rubric
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.scale = scale
        self.timeout = timeout
        self.temperature = temperature

    def prompt(self, run: AgentRun) -> list[dict[str, str]]:
        parts = [f"Task:\n{_text(run.input)}", f"Agent's answer:\n{_text(run.output)}"]
        if run.expected is not None:
            parts.append(f"Reference answer:\n{_text(run.expected)}")
        return [{"role": "system", "content": self.rubric}, {"role": "user", "content": "\n\n".join(parts)}]

    async def __call__(self, run: AgentRun) -> float:
        async with httpx.AsyncClient(timeout=self.timeout) as client:
            r = await client.post(self.url, headers=self.headers, json={
                "model": self.model, "messages": self.prompt(run), "temperature": self.temperature, "max_tokens": 16})
            r.raise_for_status()
            text = r.json()["choices"][0]["message"]["content"] or ""
        m = _SCORE.search(text)
        if not m:
            raise ValueError(f"the judge's reply holds no score: {text[:200]!r}")
        return max(0.0, min(1.0, float(m.group(1)) / self.scale))
