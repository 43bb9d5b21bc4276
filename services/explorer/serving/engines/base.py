"""The rollout engine Protocol: token ids in, sampled token ids with their logprobs out.

The Explorer renders chat messages to prompt token ids itself and hands them to an engine; the
engine never sees text it must re-tokenize, so what is recorded is exactly what was sampled.
Two implementations: ``hf`` (transformers + peft, the CPU default) and ``vllm`` (AsyncLLM).

Logprob convention (both engines): the logprob of a sampled token is taken from
``log_softmax(logits / temperature)`` before top-p truncation (temperature 0 counts as 1). The
Trainer recomputes exactly this from the recorded temperature, so importance ratios start at 1.
Under a grammar (structured outputs), the tokens it disallows are at -inf before the softmax: the
logprob is that of the distribution really sampled from, and the Trainer applies the same masks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol, runtime_checkable


class EngineError(RuntimeError):
    """The engine failed while serving a request (the HTTP edge answers 5xx)."""


class EngineOverloaded(EngineError):
    """The engine's queue is full (the HTTP edge answers 429/503)."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_logprobs: int = 0  # alternatives per token to return (0..20)
    grammar: str | None = None  # EBNF the response must match (services/common/grammar.py)

    def as_record(self) -> dict[str, Any]:
        record = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_tokens,
            "seed": self.seed,
            "stop": list(self.stop),
        }
        if self.grammar is not None:
            record["grammar"] = self.grammar  # the Trainer rebuilds the engine's masks from it
        return record


@dataclass(frozen=True)
class AdapterRef:
    """One loaded LoRA version: ``name`` and ``int_id`` are new for every version."""

    agent: str
    version: int
    name: str
    int_id: int
    path: str


@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    n: int = 1
    adapter: AdapterRef | None = None
    stream: bool = False  # emit an update every step; otherwise once per choice at its end


@dataclass
class ChoiceUpdate:
    """New output of one choice since its previous update."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    text: str
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None  # "stop" | "length" when the choice is complete


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    extra: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # set when the engine can no longer serve (health answers 503)


@runtime_checkable
class Engine(Protocol):
    """What the Explorer needs from a rollout engine."""

    tokenizer: Any
    max_model_len: int
    max_batch_size: int  # the most choices (n) one request may ask for

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[list[ChoiceUpdate]]:
        """Yield lists of choice updates until every choice has a finish_reason."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def add_adapter(self, adapter: AdapterRef) -> None: ...

    async def remove_adapter(self, adapter: AdapterRef) -> None: ...

    @property
    def adapters(self) -> list[str]:
        """Names of the adapter versions loaded now."""
        ...

    def stats(self) -> EngineStats: ...
