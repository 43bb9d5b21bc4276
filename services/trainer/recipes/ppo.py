"""PPO: a value head on the policy's features, GAE over each response's tokens (or one advantage
per response at sequence level), the clipped ratio and the clipped value loss."""

from __future__ import annotations

from datetime import datetime

import torch

from services.common.records import CommittedExperience
from services.trainer.algorithms.advantages import gae, terminal_rewards
from services.trainer.algorithms.masking import masked_sum
from services.trainer.algorithms.ppo import ppo_loss
from services.trainer.batches import Selection, Usable, take_oldest
from services.trainer.recipes.base import MicroBatch, clip_args, ratio_inputs


class PPO:
    name = "ppo"
    uses_critic = True
    uses_ratio = True

    def refuses(self, row: CommittedExperience, cfg) -> str | None:
        return None

    def select(self, usable: list[Usable], *, cfg, now: datetime, sel: Selection) -> None:
        take_oldest(usable, cfg=cfg, sel=sel)

    def loss(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        a = mb.algorithm
        values = mb.value_head(mb.hidden.detach())  # (B, R); the critic reads the features, never trains them
        if mb.first_epoch:
            mb.cache[mb.key] = values.detach()  # advantages stay those of the policy that sampled
        old = mb.cache[mb.key]
        if mb.sequence_level:
            adv, returns = mb.rewards - old[:, 0], mb.rewards
            adv_mask = torch.ones_like(adv)
        else:
            adv, returns = gae(terminal_rewards(mb.rewards, mb.mask), old, mb.mask, gamma=a.gamma, lam=a.lam)
            adv_mask = mb.mask
        inputs, normalizer = ratio_inputs(mb, adv)
        if mb.sequence_level:
            inputs.update(values=values[:, 0], old_values=old[:, 0], returns=returns)
        else:
            inputs.update(values=values, old_values=old, returns=returns)
        loss, stats = ppo_loss(**inputs, normalizer=normalizer, value_clip=a.value_clip, vf_coef=a.vf_coef, **clip_args(a))
        stats.update(
            adv_sum=masked_sum(adv, adv_mask), adv_sq_sum=masked_sum(adv**2, adv_mask), adv_count=adv_mask.sum(),
            value_sum=masked_sum(old, mb.mask),
        )
        return loss, stats
