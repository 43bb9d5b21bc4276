"""Carry the SDK's context (the current mark, the current agent run) into plain threads.

asyncio tasks and ``asyncio.to_thread`` copy the context, but before Python 3.14 a plain
``threading.Thread`` starts with an empty one, so ``with mark("vip"): Thread(target=work).start()``
would lose the mark. ``carry_into_threads(var)`` makes every thread started while ``var`` is set
begin with the same value of ``var``, and nothing else: only the SDK's own variables travel, the
application's contextvars keep Python's own semantics.

Pool workers are left alone: a ``ThreadPoolExecutor`` or ``multiprocessing.pool.ThreadPool``
worker thread lives on and runs later, unrelated tasks, which must not inherit the mark of
whichever task happened to start the worker. Use ``ContextThreadPoolExecutor`` (or
``asyncio.to_thread``) for per-task context there.
"""

from __future__ import annotations

import contextvars
import threading
from typing import Any

_MISSING = object()
_POOL_MODULES = ("concurrent.futures.thread", "multiprocessing.pool")
_carried: list[contextvars.ContextVar] = []
_lock = threading.Lock()
_original_start = None


def _is_pool_worker(thread: threading.Thread) -> bool:
    target = getattr(thread, "_target", None)
    return getattr(target, "__module__", None) in _POOL_MODULES


def _start(self: threading.Thread, *args: Any, **kwargs: Any) -> None:
    values = [(v, x) for v in tuple(_carried) if (x := v.get(_MISSING)) is not _MISSING and x is not None]
    if values and not _is_pool_worker(self):
        run = self.run

        def run_with_context() -> None:
            for var, value in values:
                if var.get(None) is None:  # unset here (Python < 3.14): take the starter's value
                    var.set(value)
            run()

        self.run = run_with_context  # type: ignore[method-assign]
    _original_start(self, *args, **kwargs)


def carry_into_threads(var: contextvars.ContextVar) -> None:
    """From now on, threads started while ``var`` holds a value start with that value (idempotent)."""
    global _original_start
    if var in _carried:
        return
    with _lock:
        if var not in _carried:
            _carried.append(var)
        if _original_start is None:
            _original_start = threading.Thread.start
            threading.Thread.start = _start  # type: ignore[method-assign]
