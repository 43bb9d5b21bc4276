"""The SDK's context: the current mark and the current agent run, one contextvar each.

``mark`` sets the first and the runners set the second; the selection strategies and the call
tracking in ``client.py`` read them. Being contextvars, both follow the code into asyncio tasks and
``asyncio.to_thread``; for other threads, see ``runner_sdk.threads``.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

from runner_sdk.records import AgentRun, Mark

mark_var: contextvars.ContextVar[Mark | None] = contextvars.ContextVar("kaizen_mark", default=None)
run_var: contextvars.ContextVar[AgentRun | None] = contextvars.ContextVar("kaizen_run", default=None)


def current_mark() -> Mark | None:
    return mark_var.get()


def current_run() -> AgentRun | None:
    return run_var.get()


@contextlib.contextmanager
def running(run: AgentRun) -> Iterator[AgentRun]:
    """Make ``run`` the current run inside the block (and in the tasks started from it)."""
    token = run_var.set(run)
    try:
        yield run
    finally:
        run_var.reset(token)
