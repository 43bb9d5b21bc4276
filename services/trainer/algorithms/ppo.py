"""PPO (Schulman et al. 2017, arXiv:1707.06347): clipped surrogate + clipped value loss.

Advantages come from GAE over a learned value head (see ``advantages.gae``). The critic is a small
MLP head on the policy's final hidden states, detached: it reads the policy's features without
pushing gradients into the policy's LoRA (no second model, no second forward pass).

Shapes: token level: (B, T) tensors with a (B, T) mask; sequence level (the whole response is one
action, as in MARFT): (B,) tensors with a (B,) mask. ``weights`` has the shape of ``mask`` and
down-weights stale experiences (1.0 otherwise). The KL penalty to the reference is added once, by
the learner, for every objective that uses the ratio (``surrogate.kl_penalty``).
"""

from __future__ import annotations

import torch

from services.trainer.algorithms.masking import aggregate
from services.trainer.algorithms.surrogate import clipped_surrogate


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *, clip: float
) -> torch.Tensor:
    """Per-element ``0.5 * max((V - G)^2, (V_old + clip(V - V_old, -c, c) - G)^2)`` (PPO2 value clipping)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)


def ppo_loss(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    normalizer: float,
    clip_low: float,
    clip_high: float,
    value_clip: float,
    vf_coef: float,
    value_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one shard of the batch: its share of the batch's mean, ready for ``backward``.

    ``value_mask`` (shape of ``mask``; default ``mask``): where the value loss applies, when the
    critic also learns states the policy does not act in (teammates' turns of a joint episode)."""
    pg, ratio, was_clipped = clipped_surrogate(logprobs, old_logprobs, advantages, clip_low=clip_low, clip_high=clip_high)
    vl = clipped_value_loss(values, old_values, returns, clip=value_clip)
    w = weights * mask
    policy_loss = aggregate(pg, w, normalizer)
    value_loss = aggregate(vl, mask if value_mask is None else value_mask, normalizer)
    loss = policy_loss + vf_coef * value_loss
    stats = {
        "policy_loss": policy_loss.detach(),
        "value_loss": value_loss.detach(),
        "clip_frac": aggregate(was_clipped, mask, normalizer).detach(),
        "ratio_mean": aggregate(ratio.detach(), mask, normalizer),
    }
    stats["loss"] = loss.detach()
    return loss, stats
