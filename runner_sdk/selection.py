"""Which requests become training data: random sampling, explicit marking, or your own strategy.

    SamplingRate(0.1)              # a random 10% of requests
    ExplicitMarking(ttl=60)        # only requests made inside `with mark("vip"):` (or @mark)

A strategy answers per request; unselected requests get no feedback and are never trained on.
Marks live in a contextvar, so they follow the code into asyncio tasks, ``asyncio.to_thread`` and
threads started inside the mark (``runner_sdk.threads`` carries the mark into a plain
``threading.Thread`` on Python < 3.14 too). Pool workers, which outlive the task that started them,
do not inherit it: submit through ``ContextThreadPoolExecutor`` to carry a mark into pooled tasks.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from runner_sdk.threads import carry_into_threads


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


@dataclass(frozen=True)
class Mark:
    labels: tuple[str, ...]
    metadata: dict[str, Any]
    created: float


_current_mark: contextvars.ContextVar[Mark | None] = contextvars.ContextVar("kaizen_mark", default=None)


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
        carry_into_threads(_current_mark)
        self._tokens.append(_current_mark.set(m))
        return m

    def __exit__(self, *exc) -> None:
        _current_mark.reset(self._tokens.pop())

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


def current_mark() -> Mark | None:
    return _current_mark.get()


class ExplicitMarking:
    """Select exactly the requests made inside ``mark(...)``, while the mark is younger than ``ttl`` s."""

    def __init__(self, ttl: float = 60.0):
        self.ttl = ttl

    def should_select(self, info: RequestInfo) -> Decision:
        m = _current_mark.get()
        if m is None or time.monotonic() - m.created > self.ttl:
            return Decision(False)
        return Decision(True, m.labels, dict(m.metadata))


class ContextThread(threading.Thread):
    """A Thread that runs in a copy of the context it was created in (marks included)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._kaizen_context = contextvars.copy_context()

    def run(self) -> None:
        self._kaizen_context.run(super().run)


class ContextThreadPoolExecutor(ThreadPoolExecutor):
    """A ThreadPoolExecutor whose tasks run in the context of the ``submit`` call."""

    def submit(self, fn, /, *args, **kwargs):
        ctx = contextvars.copy_context()
        return super().submit(ctx.run, fn, *args, **kwargs)


def decide(strategy: SelectionStrategy, info: RequestInfo) -> Decision:
    d = strategy.should_select(info)
    return d if isinstance(d, Decision) else Decision(bool(d))
