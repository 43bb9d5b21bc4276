"""An environment, an agent and datasets for `kaizen train` (configs/examples/train-parity.yaml), with
nothing but the SDK: "Is N even or odd?", rewarded 1 when the first word of the answer is right.

    kaizen train --config configs/examples/train-parity.yaml
"""

from __future__ import annotations

import random
import re

_WORD = re.compile(r"[a-z]+")


class ParityEnv:
    """One question per episode (the runner SDK's Environment protocol)."""

    def __init__(self, task: int, max_tokens: int = 4):
        self.n = int(task)
        self.max_tokens = max_tokens

    def reset(self) -> str:
        return f"Is {self.n} even or odd?"

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        words = _WORD.findall((action or "").lower())
        right = "even" if self.n % 2 == 0 else "odd"
        return "", float(words[:1] == [right]), True, {"answer": action}


async def agent(client, observation: str) -> str:
    """The agent: one call to the model being trained (``client`` is a runner_sdk AgentClient)."""
    return await client.complete(observation, max_tokens=4)


def train_tasks() -> list[int]:
    return random.Random(0).sample(range(1000), 64)


def val_tasks() -> list[int]:
    held = sorted(set(range(1000)) - set(train_tasks()))
    return random.Random(1).sample(held, 32)
