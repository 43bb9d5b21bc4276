"""SFT: the negative log-likelihood of demonstrations (a reward at least ``sft_min_reward``, or the
``sft_label`` feedback label)."""

from __future__ import annotations

from datetime import datetime

import torch

from services.common.records import CommittedExperience
from services.trainer.algorithms.sft import sft_loss
from services.trainer.batches import Selection, TeamEpisodes, Usable, take_oldest
from services.trainer.recipes.base import MicroBatch


def is_demonstration(row: CommittedExperience, cfg) -> bool:
    a = cfg.algorithm
    if a.sft_label and a.sft_label in row.labels:
        return True
    return a.sft_min_reward is not None and row.reward is not None and row.reward >= a.sft_min_reward


class SFT:
    name = "sft"
    uses_critic = False
    uses_ratio = False
    team_rewards = False

    def refuses(self, row: CommittedExperience, cfg) -> str | None:
        if is_demonstration(row, cfg):
            return None
        return "not a demonstration (reward below sft_min_reward, no sft_label)"

    def select(self, usable: list[Usable], *, cfg, now: datetime, sel: Selection, team: TeamEpisodes) -> None:
        take_oldest(usable, cfg=cfg, sel=sel)

    def loss(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return sft_loss(logprobs=mb.logprobs, mask=mb.mask, weights=mb.weights.unsqueeze(-1), normalizer=mb.norms.tokens)
