"""PPO: a value head on the policy's features, GAE over each response's tokens (or one advantage
per response at sequence level), the clipped ratio and the clipped value loss. The calls of one
episode (task_id + run_id) are credited in order: GAE runs through the episode, turn by turn at
sequence level, with the reward at its last call. When teammates act in the episode too
(``algorithm.team_credit``), their calls are turns of the joint episode: each is one step valued by
this agent's critic (a critic of the joint state), and the credit runs through them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from services.trainer.batches import episodes_of
from services.trainer.recipes.base import BaseRecipe, MicroBatch, RecipeConfig, clip_args, ratio_inputs

if TYPE_CHECKING:
    import torch


class PPOConfig(RecipeConfig):
    gamma: float = Field(default=1.0, ge=0, le=1, description="Discount.")
    lam: float = Field(default=0.95, ge=0, le=1, description="GAE lambda.")
    value_clip: float = Field(default=0.2, gt=0, description="Value-loss clipping range.")
    vf_coef: float = Field(default=0.5, ge=0, description="Weight of the value loss.")
    critic_lr: float = Field(default=1e-3, gt=0, description="Learning rate of the value head.")


class PPO(BaseRecipe):
    name = "ppo"
    Config = PPOConfig
    legacy_keys = {k: k for k in ("gamma", "lam", "value_clip", "vf_coef", "critic_lr")}
    uses_critic = True
    uses_ratio = True
    config: PPOConfig

    def loss(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # the learner's half (the driver, which selects, loads no torch)
        from services.trainer.algorithms.advantages import gae, terminal_rewards
        from services.trainer.algorithms.masking import masked_sum
        from services.trainer.algorithms.ppo import ppo_loss

        a = self.config
        values = mb.value_head(mb.hidden.detach())  # (B, R); the critic reads the features, never trains them
        if mb.first_epoch:
            mb.cache[mb.key] = values.detach()  # advantages stay those of the policy that sampled
        old = mb.cache[mb.key]
        episodes = episodes_of(mb.items)
        if len(episodes) < len(mb.items):  # some episode has several calls (or teammates' turns): credit through it
            adv, returns = _episode_credit(mb, old, episodes, a)
        elif mb.sequence_level:
            adv, returns = mb.rewards - old[:, 0], mb.rewards
        else:
            adv, returns = gae(terminal_rewards(mb.rewards, mb.mask), old, mb.mask, gamma=a.gamma, lam=a.lam)
        adv_mask = mb.own if mb.sequence_level else mb.mask
        inputs, normalizer = ratio_inputs(mb, adv)
        value_mask = mb.value_mask if mb.value_mask is not None else mb.mask
        if mb.sequence_level:  # the critic learns every turn's value, teammates' turns included
            inputs.update(values=values[:, 0], old_values=old[:, 0], returns=returns, value_mask=value_mask[:, 0])
        else:
            inputs.update(values=values, old_values=old, returns=returns, value_mask=value_mask)
        loss, stats = ppo_loss(**inputs, normalizer=normalizer, value_clip=a.value_clip, vf_coef=a.vf_coef, **clip_args(mb.objective))
        stats.update(
            adv_sum=masked_sum(adv, adv_mask), adv_sq_sum=masked_sum(adv**2, adv_mask), adv_count=adv_mask.sum(),
            value_sum=masked_sum(old, mb.mask),
        )
        return loss, stats


    def statistics(self, sums: dict[str, float], *, tokens: float) -> dict[str, float]:
        """The advantages' mean and std over the trained tokens (or responses), the critic's mean value."""
        out = dict(sums)
        n = max(out.pop("adv_count", 0.0), 1.0)
        mean = out.pop("adv_sum", 0.0) / n
        out["advantage_mean"], out["advantage_std"] = mean, max(out.pop("adv_sq_sum", 0.0) / n - mean**2, 0.0) ** 0.5
        out["value_mean"] = out.pop("value_sum", 0.0) / max(tokens, 1.0)
        return out


def _episode_credit(mb: MicroBatch, old: torch.Tensor, episodes, a: PPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns when calls form episodes (the learner keeps an episode in one
    micro-batch): token-level GAE through the episode's sampled tokens, or turn-level GAE at
    sequence level, the reward (this agent's last call's) at the end of the episode's last call.
    A teammate's call (a context item, one token long) is one step of the trajectory, its value the
    critic's at the start of that turn; its advantage is never used, its return trains the critic."""
    import torch

    from services.trainer.algorithms.advantages import episode_gae, turn_gae

    row = {id(it): b for b, it in enumerate(mb.items)}
    lengths = (mb.value_mask if mb.value_mask is not None else mb.mask).sum(1).long().tolist()
    if mb.sequence_level:
        adv, ret = torch.zeros(len(mb.items), device=old.device), torch.zeros(len(mb.items), device=old.device)
    else:
        adv, ret = torch.zeros_like(old), torch.zeros_like(old)
    for calls in episodes:
        rows = [row[id(c)] for c in calls]
        own = [c for c in calls if not c.context]
        if not own:
            continue
        reward = own[-1].reward
        if mb.sequence_level:
            ta, tr = turn_gae(old[rows, 0], reward, gamma=a.gamma, lam=a.lam)
            adv[rows], ret[rows] = ta, tr
            continue
        ea, er = episode_gae([old[b, : lengths[b]] for b in rows], reward, gamma=a.gamma, lam=a.lam)
        for b, x, y in zip(rows, ea, er):
            adv[b, : lengths[b]], ret[b, : lengths[b]] = x, y
    return adv, ret
