"""The Trainer's plain-products attention (``trainer.attention`` eager, and auto's choice on a CPU in bfloat16).

transformers' eager attention copies each key-value head's keys and values out to every query head
that shares it (``repeat_kv``: 3x SmolLM2's), multiplies the scores by the scale as a pass of their
own, adds the mask into a new tensor, and takes the softmax into float32 and back; the backward
retraces each and sums the copies' gradients. On a 2-core CPU those passes over the scores were
most of an attention's time. ``gqa_eager`` does the same arithmetic on the grouped layout: each
key-value head's query heads are one matrix of rows against its keys (a view, no copy), the scale
is folded into the queries, the mask is added in place, and the softmax gives the queries' dtype
(torch sums it in float32, as the float32 softmax does, and rounds once). Same outputs as
transformers' eager attention up to the scores' rounding; SmolLM2's step in bfloat16 on a Xeon
with AMX: an attention's forward and backward 2.7 against 6.7 ms (docs/TRAINER.md).

Models whose eager attention does more (soft-capping, attention sinks, a sliding window passed
as an argument) take their own module's eager attention unchanged.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

NAME = "kaizen_eager"  # the name the model's config runs it under (transformers' attention and mask interfaces)
_PLAIN_KWARGS = {"position_ids", "cache_position", "past_key_values", "output_attentions", "use_cache", "is_causal"}


def gqa_eager(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs):
    """transformers' attention signature: query (B, H, T, D), key and value (B, KV, S, D), an additive
    or boolean mask (B, 1, T, S); returns ((B, T, H, D), None)."""
    extra = {k for k, v in kwargs.items() if v is not None and k not in _PLAIN_KWARGS}
    B, H, T, D = query.shape
    KV, S = key.shape[1], key.shape[2]
    if extra or H % KV or value.shape[-1] != D:
        own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if own is None:
            raise ValueError(f"trainer.attention eager: {type(module).__name__} passes {sorted(extra)} and its module "
                             "has no eager_attention_forward; use trainer.attention=sdpa")
        return own(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    G = H // KV
    scores = (query * scaling).reshape(B, KV, G * T, D) @ key.transpose(2, 3)  # (B, KV, G x T, S)
    if attention_mask is not None:
        grouped = scores.view(B, KV, G, T, S)
        mask = attention_mask[:, :, :, :S].unsqueeze(1)  # (B, 1, 1, T, S)
        if mask.dtype == torch.bool:
            grouped.masked_fill_(~mask, torch.finfo(scores.dtype).min)
        else:
            grouped.add_(mask.to(scores.dtype))
    probs = torch.softmax(scores, dim=-1)
    if dropout and module.training:
        probs = nn.functional.dropout(probs, p=dropout)
    out = (probs @ value).view(B, H, T, D)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make ``NAME`` a model config's ``_attn_implementation`` (idempotent); returns it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, gqa_eager)
    AttentionMaskInterface.register(NAME, eager_mask)
    return NAME
