"""Objectives as recipes: how each one selects its batch, computes advantages, builds the inputs of
its pure loss (services/trainer/algorithms/) and reports its statistics. The learner knows none of
them by name.

Adding an objective: one recipe (a ``BaseRecipe`` subclass with its ``Config`` section), one loss
under algorithms/, and their tests. A built-in one is listed in ``BUILT_IN`` below; one of your own
is named in the config as ``algorithm.name: package.module:RecipeClass`` (loaded in the Trainer and
in every learner process), or registered in-process with ``register``.
"""

from __future__ import annotations

import importlib

from services.trainer.recipes.base import GATHER_IDS, BaseRecipe, MicroBatch, Recipe, RecipeConfig, Scorer
from services.trainer.recipes.grpo import GRPO
from services.trainer.recipes.opd import OPD
from services.trainer.recipes.ppo import PPO
from services.trainer.recipes.rft import RFT
from services.trainer.recipes.sft import SFT
from services.trainer.sections import ObjectiveSection

BUILT_IN: tuple[type[Recipe], ...] = (PPO, GRPO, SFT, RFT, OPD)
REGISTRY: dict[str, type[Recipe]] = {r.name: r for r in BUILT_IN}


def register(recipe: type[Recipe]) -> type[Recipe]:
    """Make ``recipe`` known by its ``name`` in this process (usable as a class decorator)."""
    known = REGISTRY.get(recipe.name)
    if known is not None and known is not recipe:
        raise ValueError(f"an objective named {recipe.name!r} is already registered ({known.__module__}.{known.__qualname__})")
    REGISTRY[recipe.name] = recipe
    return recipe


def recipe_class(name: str) -> type[Recipe]:
    """The recipe ``name`` names: a registered name, or ``module:Class`` (imported and registered)."""
    if name in REGISTRY:
        return REGISTRY[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot load the objective {name!r}: {e}") from e
        if not (isinstance(cls, type) and isinstance(getattr(cls, "name", None), str) and hasattr(cls, "loss")):
            raise ValueError(f"{name!r} is not a recipe (a class with a name and a loss, see services/trainer/recipes/base.py)")
        return register(cls)
    raise ValueError(f"unknown algorithm {name!r}; use one of {', '.join(sorted(REGISTRY))} or module:RecipeClass")


def build_recipe(name: str, section: RecipeConfig | None, objective: ObjectiveSection) -> Recipe:
    cls = recipe_class(name)
    return cls(section if section is not None else cls.Config(), objective)


__all__ = ["BUILT_IN", "GATHER_IDS", "BaseRecipe", "MicroBatch", "REGISTRY", "Recipe", "RecipeConfig", "Scorer", "build_recipe",
           "recipe_class", "register"]
