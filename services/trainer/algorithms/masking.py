"""Masking and aggregation over padded (B, T) token tensors.

Responses in a batch have different lengths; they are right-padded to T and ``mask`` is 1 on real
response tokens, 0 on padding. Every loss is a masked sum divided by a normalizer chosen once for
the whole (possibly sharded) batch, so micro-batches and data-parallel shards add up exactly to the
full-batch loss.
"""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1 (over ``dim``, or everything)."""
    masked = values * mask
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over masked entries; 0 where nothing is unmasked."""
    return masked_sum(values, mask, dim) / mask.sum(dim).clamp(min=1)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, normalizer: float) -> torch.Tensor:
    """``sum(per_token * mask) / normalizer``: the batch-level loss contribution of this shard.

    With ``normalizer`` = the number of response tokens in the whole batch this is the token-mean
    loss (DAPO's choice: long responses are not down-weighted per token).
    """
    return masked_sum(per_token, mask) / max(normalizer, 1e-8)
