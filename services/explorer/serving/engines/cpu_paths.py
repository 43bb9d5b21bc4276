"""The hf engine's fast paths on a CPU: pre-packed linear weights, decode-step attention, its threads.

A decode step runs every sequence's one new token through the model. Two of PyTorch's CPU kernels
do badly at that shape (measured on an AMD EPYC with AVX-512 BF16, one thread, SmolLM2's shapes):

- ``F.linear`` hands oneDNN the plain (out, in) weight, which it lays out again into its blocked
  format on every call; at 1 to 16 rows that costs as much as the product. Packing each weight once
  (``torch.ops.mkldnn._reorder_linear_weight``, what torch.compile's CPU freezing pass does) and
  calling oneDNN's linear on it made the products 1.3-1.9x faster in bfloat16, with results equal bit
  for bit. In float32 it was slower at one row and not bit-equal, so it is on by default only in
  bfloat16 on a CPU that computes it natively (``packing_helps``).
- ``F.scaled_dot_product_attention`` with one query per sequence and a padding mask took 0.8 ms at 8
  sequences of 100 tokens and 7 ms at 32 of 200, per layer: more than the rest of the step. The
  same attention as two batched products and a softmax in float32 (``decode_attention``) took 0.16
  and 1.1 ms (5-6.5x faster from 8 to 32 sequences of 100-400 tokens), as close to a float64
  reference as SDPA's own result (max error 0.0009-0.0019 against SDPA's 0.0012-0.0022 in bfloat16).
  Prefill (several queries a sequence) keeps SDPA.

Both leave the model's modules what they were (peft wraps the linear layers for adapters as before
and calls them as its base layers) and fall back to the stock kernel for anything else: a GPU
tensor, gradients, another dtype, or an attention with extras (soft-capping, sinks, a bias).
"""

from __future__ import annotations

import logging
import os
import types

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from services.common.cpus import usable_cpus
from services.common.models import cpu_has_native_bf16

log = logging.getLogger(__name__)

DECODE_ATTENTION = "kaizen_cpu_decode"  # the name the attention is registered under with transformers


def default_torch_threads(device: torch.device) -> int | None:
    """The engine's torch threads when ``engine.torch_threads`` is unset: on a CPU, one fewer than torch's
    own default (the physical cores) or the CPUs this process may use (a container's CPU quota included:
    services/common/cpus.py), whichever is fewer, so the
    server's own thread (HTTP, recording) keeps one; None (torch's default) when OMP_NUM_THREADS or
    MKL_NUM_THREADS says how many, or off the CPU. With its OpenMP threads on every core, their spinning
    and the server's thread took turns: on 2 cores SmolLM2 decoded 13 / 82 / 227 tokens/s at 1 / 8 / 32
    sequences on two threads against 23 / 141 / 268 on one (tests/bench/smollm2.py, docs/ENGINES.md)."""
    if device.type != "cpu" or os.environ.get("OMP_NUM_THREADS") or os.environ.get("MKL_NUM_THREADS"):
        return None
    return max(1, min(usable_cpus(), torch.get_num_threads()) - 1)


def packing_helps(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether this CPU and dtype gain from packing: bfloat16 on a CPU that computes it natively
    (AVX-512 BF16, which CPUs with AMX have too)."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and cpu_has_native_bf16())


def linear_bytes(model: nn.Module) -> int:
    """What a packed copy of ``model``'s linear weights takes (tied weights once)."""
    weights = {id(m.weight): m.weight for m in model.modules() if type(m) is nn.Linear}
    return sum(w.numel() * w.element_size() for w in weights.values())


def packing_budget() -> int:
    """The most memory packed copies may take by default: a quarter of the memory available now (the
    cgroup's limit when lower), and 2 GiB at most (the linear weights of a ~1B model in bfloat16)."""
    available = 2 << 30
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2]}
        available = info.get("MemAvailable", available * 4)
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            with open("/sys/fs/cgroup/memory.current") as f:
                available = min(available, int(limit) - int(f.read().strip()))
    except (OSError, ValueError):
        pass
    return max(0, min(2 << 30, available // 4))


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    w = self.weight
    if (x.dtype != self._kaizen_packed.dtype or x.device.type != "cpu" or self._kaizen_of != (w.data_ptr(), w._version)
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        return nn.functional.linear(x, w, self.bias)  # other inputs, gradients, or a weight changed since packing
    return torch.ops.mkldnn._linear_pointwise(x, self._kaizen_packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Give every ``nn.Linear`` of ``model`` on the CPU a pre-packed copy of its weight (``linear_bytes``
    more memory) and the forward above; returns how many. Made for serving, where the base weights
    never change (a weight changed in place after it is computed by ``F.linear`` again)."""
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu" and not hasattr(module, "_kaizen_packed"):
            w = module.weight
            module._kaizen_packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            module._kaizen_of = (w.data_ptr(), w._version)
            module.forward = types.MethodType(_packed_forward, module)
            n += 1
    return n


# what the plain products below do not do (soft-capping, attention sinks, a bias, a paged cache, sparse indices)
_EXTRAS = ("softcap", "s_aux", "sinks", "position_bias", "cache", "indices", "block_indices")

# models whose attention is plain SDPA over the mask transformers builds (their code does not branch on
# the implementation's name, as some sparse-attention models' does)
DECODE_ATTENTION_MODELS = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "smollm3",
                           "olmo2", "gemma", "gemma3_text", "granite", "starcoder2")


def decode_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: ``query`` (B, H, q, D), ``key`` (B, KV, L, D) and ``value``
    (B, KV, L, Dv), ``attention_mask`` SDPA's ((B or 1, 1, q, L), bool, True where a token is seen, or
    additive; None for none). One query a sequence on the CPU without gradients: scores and softmax and
    the weighted sum in float32, the query heads grouped by their key-value head (head h on key-value
    head h // (H / KV), as transformers' repeat_kv); anything else: transformers' SDPA attention."""
    B, H, q_len, D = query.shape
    KV, L, Dv = key.shape[1], key.shape[2], value.shape[-1]
    mask = attention_mask
    if (q_len != 1 or query.device.type != "cpu" or torch.is_grad_enabled() or dropout or H % KV
            or any(kwargs.get(k) is not None for k in _EXTRAS)
            or (mask is not None and (mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] != L
                                      or not (mask.dtype == torch.bool or mask.is_floating_point())))):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = D ** -0.5 if scaling is None else scaling
    scores = (query.reshape(B, KV, H // KV, D).float() @ key.float().transpose(-1, -2)).mul_(scale)  # (B, KV, H/KV, L)
    if mask is not None:
        mask = mask[:, :, -1:, :]  # (B or 1, 1, 1, L)
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask.float())
    out = torch.softmax(scores, dim=-1) @ value.float()  # (B, KV, H/KV, Dv)
    return out.reshape(B, 1, H, Dv).to(query.dtype), None


def use_decode_attention(model: nn.Module) -> bool:
    """Register ``decode_attention`` (with SDPA's masks) and switch ``model`` to it. False, and the
    model left as it was, unless it is one of DECODE_ATTENTION_MODELS on SDPA attention with a config
    of one part."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    config = model.config
    if (getattr(config, "_attn_implementation", None) != "sdpa" or config.model_type not in DECODE_ATTENTION_MODELS
            or (hasattr(config, "get_text_config") and config.get_text_config() is not config)):
        return False
    AttentionInterface.register(DECODE_ATTENTION, decode_attention)
    AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)
    try:
        model.set_attn_implementation(DECODE_ATTENTION)
    except Exception as e:  # noqa: BLE001 - the stock attention still works
        log.info("decode attention not used: %s", e)
        return False
    return config._attn_implementation == DECODE_ATTENTION
