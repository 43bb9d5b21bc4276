"""RL objectives, one file each, chosen by ``algorithm.name`` from this registry.

Each entry says what the training step must prepare for it; the math lives in pure functions
(``ppo.ppo_loss``, ``grpo.grpo_loss``, ``sft.sft_loss``, ``advantages``, ``masking``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from services.trainer.algorithms import grpo, ppo, sft


@dataclass(frozen=True)
class Objective:
    name: str
    loss: Callable
    uses_critic: bool  # PPO: a value head and GAE
    uses_groups: bool  # GRPO: batches of whole task_id groups, group-relative advantages
    uses_ratio: bool  # importance ratio against the recorded sampling logprobs


REGISTRY: dict[str, Objective] = {
    "ppo": Objective("ppo", ppo.ppo_loss, uses_critic=True, uses_groups=False, uses_ratio=True),
    "grpo": Objective("grpo", grpo.grpo_loss, uses_critic=False, uses_groups=True, uses_ratio=True),
    "sft": Objective("sft", sft.sft_loss, uses_critic=False, uses_groups=False, uses_ratio=False),
}

__all__ = ["Objective", "REGISTRY"]
