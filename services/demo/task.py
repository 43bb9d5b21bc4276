"""The demo's task: "Is N even or odd?", rewarded 1 when the first word of the answer is right.

A verifiable reward that a random tiny model cannot hit by chance (it has to say exactly "even" or
"odd"), that a format-only warm start brings to about one half (the right words, a coin flip), and
that only the online loop can push further: the model must learn to read the last digit.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

_WORD = re.compile(r"[a-z]+")


def question(n: int) -> str:
    return f"Is {n} even or odd?"


def answer(n: int) -> str:
    return "even" if n % 2 == 0 else "odd"


def reward(n: int, reply: str | None) -> float:
    words = _WORD.findall((reply or "").lower())
    return 1.0 if words[:1] == [answer(n)] else 0.0


@dataclass(frozen=True)
class Split:
    train: list[int]
    heldout: list[int]
    warm_start: list[tuple[int, str]]  # (number, random label): teaches the format, not the rule


def split(seed: int, n_train: int, n_heldout: int, n_warm: int) -> Split:
    rng = random.Random(seed)
    numbers = list(range(1000))
    rng.shuffle(numbers)
    train, heldout = numbers[:n_train], numbers[n_train : n_train + n_heldout]
    warm = [(n, rng.choice(["even", "odd"])) for n in train[:n_warm]]
    return Split(train=train, heldout=heldout, warm_start=warm)


class ParityEnv:
    """The Environment the runner SDK drives: one question, one answer, one reward."""

    def __init__(self, n: int):
        self.n = n

    def reset(self) -> str:
        return question(self.n)

    def step(self, action: str):
        r = reward(self.n, action)
        return None, r, True, {"answer": answer(self.n), "reply": action}
