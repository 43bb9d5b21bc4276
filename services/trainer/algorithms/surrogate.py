"""The clipped importance-ratio surrogate and the KL estimator shared by PPO and GRPO.

Both objectives optimise the PPO surrogate (Schulman et al. 2017, eq. 7) with the logprobs
recorded at sampling time as the old policy, so lag between the serving version and the trained
one is corrected by the ratio rather than ignored.
"""

from __future__ import annotations

import torch

from services.trainer.algorithms.masking import aggregate


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-element PPO loss ``-min(r A, clip(r, 1-clip_low, 1+clip_high) A)``.

    Shapes: any, all the same: (B, T) for token level, (B,) for sequence level.
    Returns (loss, ratio, clipped) where ``clipped`` is 1.0 where the clipped term was chosen.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped = clipped_ratio * advantages
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = (clipped < unclipped).float()
    return loss, ratio, was_clipped


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate ``exp(ref - lp) - (ref - lp) - 1`` (Schulman's k3).

    Unbiased for samples from pi and never negative; 0 where the two policies agree.
    """
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, normalizer: float) -> torch.Tensor:
    """The KL term of PPO and GRPO's objectives (GRPO eq. 3): k3 per token, masked, over ``normalizer``
    tokens of the batch. Shapes: (B, T) each."""
    return aggregate(kl_k3(logprobs, ref_logprobs), mask, normalizer)
