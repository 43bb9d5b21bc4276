"""Run code on another thread with the SDK's context (the current mark and agent run), when you ask.

asyncio tasks and ``asyncio.to_thread`` copy the context by themselves. A plain ``threading.Thread``
(unless Python runs with ``thread_inherit_context``, the default only on free-threaded 3.14+),
``loop.run_in_executor`` and a ``ThreadPoolExecutor`` do not, and the SDK leaves them as they are: a
library does not change how its host's threads start. Opt in instead:

    with mark("vip"):
        ContextThread(target=work).start()            # a Thread that runs in the creator's context
        pool.submit(carry_context(work), item)        # any executor, thread or callback API
        await loop.run_in_executor(None, carry_context(work), item)

or create the pool as a ``ContextThreadPoolExecutor``, whose every task runs in the context of its
``submit`` call. Only the task carries the context, never a pool's worker thread: a worker lives on
and runs later, unrelated tasks, which must not inherit the mark of whichever task started it.
"""

from __future__ import annotations

import contextvars
import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

R = TypeVar("R")


def carry_context(fn: Callable[..., R]) -> Callable[..., R]:
    """``fn`` bound to a copy of the current context: wherever it is called, it runs in that context."""
    captured = contextvars.copy_context()

    @functools.wraps(fn)
    def in_context(*args: Any, **kwargs: Any) -> R:
        # A fresh copy per call: one Context cannot be entered twice at once, and what one call sets
        # must not leak into the next (the same rule as asyncio.to_thread).
        return captured.copy().run(fn, *args, **kwargs)

    return in_context


class ContextThread(threading.Thread):
    """A Thread whose ``run()`` (a subclass's own included) runs in a copy of the context it was created in."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # Bind the run() this instance will call (a subclass's override, once its class exists) to
        # the context; only this instance changes, never threading.Thread.
        self.run = functools.partial(contextvars.copy_context().run, self.run)  # type: ignore[method-assign]


class ContextThreadPoolExecutor(ThreadPoolExecutor):
    """A ThreadPoolExecutor whose tasks (``submit`` and ``map``) run in the context of the ``submit`` call."""

    def submit(self, fn, /, *args, **kwargs):
        return super().submit(contextvars.copy_context().run, fn, *args, **kwargs)
