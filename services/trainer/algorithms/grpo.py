"""GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300, eq. 3): group-relative advantages,
the clipped ratio, and an optional KL penalty to the reference policy (k3 estimator).

No critic: each experience's advantage is its reward relative to the other experiences of the
same task_id (see ``advantages.group_relative``), broadcast to every token at token level or used
once per response at sequence level. Shapes as in ``ppo``.
"""

from __future__ import annotations

import torch

from services.trainer.algorithms.masking import aggregate
from services.trainer.algorithms.surrogate import clipped_surrogate, kl_k3


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
    token_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    token_mask: torch.Tensor | None = None,
    token_normalizer: float = 1.0,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    pg, ratio, was_clipped = clipped_surrogate(logprobs, old_logprobs, advantages, clip_low=clip_low, clip_high=clip_high)
    policy_loss = aggregate(pg, weights * mask, normalizer)
    loss = policy_loss
    stats = {
        "policy_loss": policy_loss.detach(),
        "clip_frac": aggregate(was_clipped, mask, normalizer).detach(),
        "ratio_mean": aggregate(ratio.detach(), mask, normalizer),
    }
    if kl_coef and ref_logprobs is not None:
        kl = aggregate(kl_k3(token_logprobs, ref_logprobs), token_mask, token_normalizer)
        loss = loss + kl_coef * kl
        stats["kl_loss"] = kl.detach()
    stats["loss"] = loss.detach()
    return loss, stats
