"""The demo's tasks by name (``tools.task``), each a :class:`services.demo.task.Task`.

A module of its own, above the tasks: each task module imports ``services.demo.task`` for the
shared parts, and this one imports the tasks, so the imports go one way."""

from __future__ import annotations

from services.demo import tools_task, units_task
from services.demo.task import Task

TASKS: dict[str, Task] = {"calculator": tools_task.TASK, "units": units_task.TASK}


def get(name: str) -> Task:
    """The task called ``name`` (``tools.task``)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; use one of {', '.join(TASKS)}")
    return TASKS[name]
