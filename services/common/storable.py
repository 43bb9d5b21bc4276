"""What a value must be for every buffer database to store it, checked before it is accepted.

JSON allows strings that no database stores: a lone UTF-16 surrogate (``"\\ud800"``) cannot be
encoded as UTF-8 (SQLite and PostgreSQL both refuse it), and PostgreSQL's text type refuses NUL.
A request carrying one must be refused at the edge with a 400 naming the field: once it is
accepted, its record can never be written. Column widths of the buffer are stated here too.
"""

from __future__ import annotations

from typing import Any

# Widths of the buffer's string columns that a client's value lands in (services/common/buffer/schema.py).
TASK_ID_MAX = 256
RUN_ID_MAX = 128


def string_problem(text: str) -> str | None:
    """Why ``text`` cannot be stored, or None when it can."""
    if "\x00" in text:
        return f"contains a NUL character (\\u0000) at position {text.index(chr(0))}"
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"contains a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x}) at position {e.start}"
    return None


def find_unstorable(value: Any, path: str) -> tuple[str, str] | None:
    """The first string inside ``value`` (keys included, depth first) that cannot be stored:
    (its dotted path, why), or None."""
    stack = [(path, value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            if (why := string_problem(v)) is not None:
                return where, why
        elif isinstance(v, dict):
            items = []
            for k, item in v.items():
                key = str(k)
                if (why := string_problem(key)) is not None:
                    return f"{where}.<key>", why
                items.append((f"{where}.{key}", item))
            stack.extend(reversed(items))
        elif isinstance(v, (list, tuple)):
            stack.extend(reversed([(f"{where}.{i}", item) for i, item in enumerate(v)]))
    return None
