"""Objectives as recipes: how each one selects its batch, computes advantages and builds the
inputs of its pure loss (services/trainer/algorithms/). The learner knows none of them by name.

Adding an objective: one recipe file here (registered below), one loss file under algorithms/,
and their tests.
"""

from __future__ import annotations

from services.trainer.recipes.base import MicroBatch, Recipe
from services.trainer.recipes.grpo import GRPO
from services.trainer.recipes.ppo import PPO
from services.trainer.recipes.sft import SFT

REGISTRY: dict[str, Recipe] = {r.name: r for r in (PPO(), GRPO(), SFT())}


def recipe_for(name: str) -> Recipe:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; known: {', '.join(sorted(REGISTRY))}") from None


__all__ = ["MicroBatch", "REGISTRY", "Recipe", "recipe_for"]
