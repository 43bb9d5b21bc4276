"""The parity demo's task: "Is N even or odd?", rewarded 1 when the first word of the answer is right.

A verifiable reward that a random tiny model cannot hit by chance (it has to say exactly "even" or
"odd"), that a format-only warm start brings to about one half (the right words, chosen by a code of the
last digit that is wrong for half the digits: see ``warm_start_code``), and that only the online
loop can push further: it must find the right answer for the five digits the code gets wrong, on
numbers it has never seen.
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
    warm_start: list[tuple[int, str]]  # (number, label): the format and the code, not the rule


_OTHER = {"even": "odd", "odd": "even"}


def warm_start_code(seed: int) -> dict[int, str]:
    """The warm start's answer for each last digit: a random code that is right for exactly five
    digits and wrong for the other five, so it carries no information about parity (a model that
    follows it scores 0.5) while it teaches the format and to read the number's last digit."""
    rng = random.Random(seed + 1)
    right = set(rng.sample(range(10), 5))
    return {d: answer(d) if d in right else _OTHER[answer(d)] for d in range(10)}


def split(seed: int, n_train: int, n_heldout: int, n_warm: int) -> Split:
    rng = random.Random(seed)
    numbers = list(range(1000))
    rng.shuffle(numbers)
    train, heldout = numbers[:n_train], numbers[n_train : n_train + n_heldout]
    # Warm-start questions spread evenly over the last digits, labelled by the no-information code.
    # (Random labels per question were tried first: the model then ignores the number, answers
    # every question alike, and GRPO, which only learns from groups that disagree, rarely recovers.)
    # Each is taught the code's answer three times and the other answer once, so the model ends up
    # answering the code's way about 3 times in 4, not always: GRPO needs groups that disagree.
    code = warm_start_code(seed)
    by_digit = {d: [n for n in train if n % 10 == d] for d in range(10)}
    digits = [d for d in range(10) if by_digit[d]]
    picked = [by_digit[d][(i // len(digits)) % len(by_digit[d])] for i in range(n_warm) for d in [digits[i % len(digits)]]]
    warm = [(n, label) for n in picked for label in [code[n % 10]] * 3 + [_OTHER[code[n % 10]]]]
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


# The release gate's suite (the Explorer's release.gate.suite names these): numbers above the
# traffic and held-out range, answered greedily, so two versions are compared on the same answers.


def gate_numbers() -> list[int]:
    return list(range(1000, 1032))


async def gate_agent(client, observation: str) -> str:
    return await client.complete(observation, max_tokens=1, temperature=0)
