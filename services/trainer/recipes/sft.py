"""SFT: the negative log-likelihood of labelled rows: experiences whose feedback carries the label
``algorithm.sft.label`` (a reviewer's "this is how it is done"), and, when ``algorithm.sft.min_reward``
is set, rewarded rows at least that good. For self-imitation of rewarded traffic alone, see ``rft``.
Demonstrations posted to /demonstrations are trained by every objective's supervised term, not here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field, model_validator

from services.common.records import CommittedExperience
from services.trainer.recipes.base import BaseRecipe, MicroBatch, RecipeConfig

if TYPE_CHECKING:
    import torch


class SFTConfig(RecipeConfig):
    label: str | None = Field(default="demonstration", description="Train on experiences with this feedback label.")
    min_reward: float | None = Field(
        default=None, description="Also train on experiences with at least this reward (absent: labelled rows only).")

    @model_validator(mode="after")
    def _picks_something(self) -> "SFTConfig":
        if not self.label and self.min_reward is None:
            raise ValueError("sft needs algorithm.sft.label or algorithm.sft.min_reward to pick the rows it imitates")
        return self


def imitation_loss(mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The supervised objectives' loss: token-mean NLL of the batch, each row at its staleness weight."""
    from services.trainer.algorithms.sft import sft_loss  # the learner's half (the driver loads no torch)

    return sft_loss(logprobs=mb.logprobs, mask=mb.mask, weights=mb.weights.unsqueeze(-1), normalizer=mb.norms.tokens)


class SFT(BaseRecipe):
    name = "sft"
    Config = SFTConfig
    legacy_keys = {"sft_label": "label", "sft_min_reward": "min_reward"}
    needs_reward = False  # a labelled row needs no reward
    config: SFTConfig

    def refuses(self, row: CommittedExperience) -> str | None:
        c = self.config
        if c.label and c.label in row.labels:
            return None
        if c.min_reward is not None and row.reward is not None and row.reward >= c.min_reward:
            return None
        return f"not labelled {c.label!r}" + (f" nor rewarded at least {c.min_reward}" if c.min_reward is not None else "")

    def loss(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return imitation_loss(mb)
