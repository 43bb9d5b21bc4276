"""Which requests become training data: random sampling, explicit marking, or your own strategy.

    SamplingRate(0.1)              # a random 10% of requests
    ExplicitMarking(ttl=60)        # only requests made inside `with mark("vip"):` (or @mark)

A strategy answers per request; unselected requests get no feedback and are never trained on.
Marks live in a contextvar (``runner_sdk.context``), so they follow the code into asyncio tasks and
``asyncio.to_thread``, and into other threads where you start them through ``runner_sdk.threads``
(``ContextThread``, ``carry_context``, ``ContextThreadPoolExecutor``).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from runner_sdk.context import current_mark, mark_var
from runner_sdk.records import Mark


@dataclass(frozen=True)
class RequestInfo:
    """What a strategy may look at: the request's input and its context."""

    input: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    selected: bool
    labels: tuple[str, ...] = ()
    metadata: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class SelectionStrategy(Protocol):
    def should_select(self, info: RequestInfo) -> Decision | bool: ...


class SamplingRate:
    """Select each request independently with probability ``p``."""

    def __init__(self, p: float, *, seed: int | None = None):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"SamplingRate needs 0 <= p <= 1, got {p}")
        self.p = p
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def should_select(self, info: RequestInfo) -> Decision:
        with self._lock:
            return Decision(self._rng.random() < self.p)


class mark:  # noqa: N801 - reads like a statement: `with mark("vip"):`
    """Mark the requests made inside as training data: context manager or decorator.

        with mark("high-quality", source="support"):
            agent.answer(question)

        @mark("demonstration")
        async def handle(request): ...
    """

    def __init__(self, *labels: str, **metadata: Any):
        self.labels = tuple(labels)
        self.metadata = metadata
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> Mark:
        m = Mark(self.labels, dict(self.metadata), time.monotonic())
        self._tokens.append(mark_var.set(m))
        return m

    def __exit__(self, *exc) -> None:
        mark_var.reset(self._tokens.pop())

    async def __aenter__(self) -> Mark:
        return self.__enter__()

    async def __aexit__(self, *exc) -> None:
        self.__exit__(*exc)

    def __call__(self, fn: Callable) -> Callable:
        labels, metadata = self.labels, self.metadata
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args, **kwargs):
                with mark(*labels, **metadata):
                    return await fn(*args, **kwargs)

            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with mark(*labels, **metadata):
                return fn(*args, **kwargs)

        return wrapper


class ExplicitMarking:
    """Select exactly the requests made inside ``mark(...)``, while the mark is younger than ``ttl`` s."""

    def __init__(self, ttl: float = 60.0):
        self.ttl = ttl

    def should_select(self, info: RequestInfo) -> Decision:
        m = current_mark()
        if m is None or time.monotonic() - m.created > self.ttl:
            return Decision(False)
        return Decision(True, m.labels, dict(m.metadata))


def decide(strategy: SelectionStrategy, info: RequestInfo) -> Decision:
    d = strategy.should_select(info)
    return d if isinstance(d, Decision) else Decision(bool(d))
