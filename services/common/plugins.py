"""User code named in a config: ``module:attr`` objects and datasets of tasks (``kaizen train``, the
release gate's evaluation suite)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from services.common.config import ConfigError


def load_object(spec: str) -> Any:
    """``module:attr`` -> the object (ConfigError naming what is wrong)."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ConfigError(f"{spec!r} must be module:attr")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot load {spec!r}: {e}") from e


def load_dataset(spec: str) -> list[Any]:
    """A .json list / .jsonl file of tasks, or ``module:attr`` (a list, or a function returning one)."""
    path = Path(spec)
    if path.suffix in (".json", ".jsonl"):
        if not path.is_file():
            raise ConfigError(f"dataset file {spec!r} does not exist")
        text = path.read_text()
        tasks = json.loads(text) if path.suffix == ".json" else [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        obj = load_object(spec)
        tasks = obj() if callable(obj) else obj
    if not isinstance(tasks, list) or not tasks:
        raise ConfigError(f"dataset {spec!r} must be a non-empty list of tasks")
    return tasks
