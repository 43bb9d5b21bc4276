"""RFT: rejection-sampling fine-tuning on the agent's own rewarded traffic (RAFT, ReST): the
negative log-likelihood of the episodes whose reward is at least ``algorithm.rft.min_reward``;
the rest are set aside. Self-imitation: the successes the agent found itself become its examples."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from services.common.records import CommittedExperience
from services.trainer.recipes.base import BaseRecipe, MicroBatch, RecipeConfig
from services.trainer.recipes.sft import imitation_loss

if TYPE_CHECKING:
    import torch


class RFTConfig(RecipeConfig):
    min_reward: float = Field(default=1.0, description="Train on experiences with at least this reward.")


class RFT(BaseRecipe):
    name = "rft"
    Config = RFTConfig
    legacy_keys = {"sft_min_reward": "min_reward"}
    config: RFTConfig

    def refuses(self, row: CommittedExperience) -> str | None:
        if row.reward >= self.config.min_reward:
            return None
        return f"reward {row.reward:g} below algorithm.rft.min_reward {self.config.min_reward:g}"

    def loss(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return imitation_loss(mb)
