"""Time-ordered identifiers for completions and experiences.

An id carries its creation time (milliseconds, hex) before a random part, so ids sort by time and
a service can tell a recently issued id (maybe still being written by some replica) from an old or
made-up one without any shared state.
"""

from __future__ import annotations

import re
import secrets
import time

_ID = re.compile(r"^[a-z]+-([0-9a-f]{12})[0-9a-f]{12}(?:-\d+)?$")


def new_id(prefix: str) -> str:
    """``prefix-<12 hex ms timestamp><12 hex random>``."""
    return f"{prefix}-{int(time.time() * 1000):012x}{secrets.token_hex(6)}"


def experience_id(completion_id: str, index: int) -> str:
    """The experience id of choice ``index`` of a completion: ``<completion id>-<index>``."""
    return f"{completion_id}-{index}"


def id_age_seconds(identifier: str, *, now: float | None = None) -> float | None:
    """Seconds since ``identifier`` was issued, or None if it is not one of our ids."""
    m = _ID.match(identifier)
    if not m:
        return None
    issued = int(m.group(1), 16) / 1000.0
    return (time.time() if now is None else now) - issued
