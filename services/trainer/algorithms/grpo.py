"""GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300, eq. 3): group-relative advantages and
the clipped ratio. Its KL penalty to the reference policy is ``surrogate.kl_penalty``, added once by
the learner.

No critic. The advantages come in computed at selection (services/trainer/recipes/grpo.py): a group
is every episode (task_id + run_id) of one task_id, an episode's reward is its last call's, and each
episode's advantage is its reward relative to the group's (``group.episode_relative``), given to
every call of the episode; here it is broadcast to every token at token level or used once per
response at sequence level. Shapes as in ``ppo``.
"""

from __future__ import annotations

import torch

from services.trainer.algorithms.masking import aggregate
from services.trainer.algorithms.surrogate import clipped_surrogate


def grpo_loss(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    normalizer: float,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    pg, ratio, was_clipped = clipped_surrogate(logprobs, old_logprobs, advantages, clip_low=clip_low, clip_high=clip_high)
    policy_loss = aggregate(pg, weights * mask, normalizer)
    loss = policy_loss
    stats = {
        "policy_loss": policy_loss.detach(),
        "clip_frac": aggregate(was_clipped, mask, normalizer).detach(),
        "ratio_mean": aggregate(ratio.detach(), mask, normalizer),
    }
    stats["loss"] = loss.detach()
    return loss, stats
