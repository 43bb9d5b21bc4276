"""What a training step needs from the logits at the response positions, without keeping a float32
copy of them per statistic: each sampled token's logprob, the entropy of each position's
distribution, and the logprobs of other named tokens (``gather``: a teacher's top-k), all under the
sampling temperature and the grammar's allowed tokens.

Written plainly (upcast, divide by the temperature, log-softmax, exp for the entropy), autograd keeps
several (B, R, V) float32 tensors alive until the backward pass: with SmolLM2's 49,152-token vocabulary
a long supervised batch of 8 x 2,000 response tokens makes each 3 GiB. Here the logits are walked in
chunks of positions, forward and backward; the backward recomputes each chunk's softmax from the
logits (kept in the model's dtype: one (B, R, V) tensor, where the plain way kept several in
float32) and writes the gradient directly:

    d logp(y) / d z = onehot(y) - p,     d H / d z = -p (log p + H),     z = logits / temperature,

so the peak is the logits, their gradient and one chunk's temporaries. The values are those of the
plain computation to float rounding (tests/unit/trainer/test_token_stats.py checks them and their
gradients against it).

Where the process has loaded the Trainer's kernels (a Policy in bfloat16 on a CPU:
services/trainer/train_kernels.py), bfloat16 logits without a grammar's masks, gathered ids or top-k
take ``token_stats_forward`` / ``_backward`` instead: two passes over each position's logits forward,
one backward, in float32 registers, no float32 copy (tests/integration/trainer/test_step_kernels.py
holds them to this path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.trainer import train_kernels

CHUNK_ELEMENTS = 1 << 24  # float32 elements per chunk's temporaries: 64 MiB each


@dataclass
class TokenStats:
    logprobs: torch.Tensor  # (B, R) float32: each response token's logprob
    entropy: torch.Tensor  # (B, R) float32: the entropy of each position's distribution (no grad unless asked)
    gathered: torch.Tensor | None  # (B, R, k) float32: the logprobs of ``gather``'s ids
    top: tuple[torch.Tensor, torch.Tensor] | None  # ((B, R, k) logprobs, ids) of the k likeliest tokens, no grad


def _chunk_len(batch: int, vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, batch * vocab))


def _log_softmax(logits: torch.Tensor, inv_temp: torch.Tensor | None, allowed: torch.Tensor | None) -> torch.Tensor:
    z = logits.float() if inv_temp is None else logits.float() * inv_temp  # None: every row at temperature 1
    if allowed is not None:
        z = z.masked_fill(~allowed, float("-inf"))
    return torch.log_softmax(z, dim=-1)


def _plogp(logp: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """p log p, 0 for a disallowed token (p = 0, log p = -inf)."""
    finite = logp if allowed is None else logp.masked_fill(~allowed, 0.0)
    return logp.exp() * finite


class _KernelStats(torch.autograd.Function):
    """The logprobs and entropy of bfloat16 logits on the CPU in two passes over each position's logits forward
    and one backward (train_kernels.cpp: token_stats_forward / _backward), no float32 copy at all."""

    @staticmethod
    def forward(ctx, logits, inv_temp, targets, mod):
        lp, ent, lse = mod.token_stats_forward(logits, inv_temp, targets)
        ctx.mod = mod
        ctx.save_for_backward(logits, inv_temp, targets, lse, ent)
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, inv_temp, targets, lse, ent = ctx.saved_tensors
        if g_lp is None and g_ent is None:
            return None, None, None, None
        none = torch.empty(0)
        grad = ctx.mod.token_stats_backward(logits, inv_temp, targets, lse, ent, none if g_lp is None else g_lp,
                                            none if g_ent is None else g_ent)
        return grad, None, None, None


class _Stats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, inv_temp, targets, allowed, gather, chunk: int, top=None):
        # ``top``: (values, ids) buffers the k likeliest tokens are written to, from the same log-softmax
        B, R = targets.shape  # logits may have more positions: they get a zero gradient
        lp = torch.empty((B, R), dtype=torch.float32, device=logits.device)
        ent = torch.empty_like(lp)
        gathered = None if gather is None else torch.empty(gather.shape, dtype=torch.float32, device=logits.device)
        for s in range(0, R, chunk):
            e = min(R, s + chunk)
            ok = None if allowed is None else allowed[:, s:e]
            logp = _log_softmax(logits[:, s:e], inv_temp, ok)
            lp[:, s:e] = logp.gather(-1, targets[:, s:e].unsqueeze(-1)).squeeze(-1)
            ent[:, s:e] = -_plogp(logp, ok).sum(-1)
            if gather is not None:
                gathered[:, s:e] = logp.gather(-1, gather[:, s:e])
            if top is not None:
                top[0][:, s:e], top[1][:, s:e] = logp.topk(top[0].shape[-1], dim=-1)
        ctx.chunk, ctx.has_allowed, ctx.has_gather = chunk, allowed is not None, gather is not None
        ctx.save_for_backward(logits, inv_temp, targets, ent, *(t for t in (allowed, gather) if t is not None))
        ctx.set_materialize_grads(False)
        return (lp, ent) if gathered is None else (lp, ent, gathered)

    @staticmethod
    def backward(ctx, g_lp, g_ent, g_gathered=None):
        logits, inv_temp, targets, ent, *rest = ctx.saved_tensors
        allowed = rest.pop(0) if ctx.has_allowed else None
        gather = rest.pop(0) if ctx.has_gather else None
        if g_lp is None and g_ent is None and g_gathered is None:
            return (None,) * 7
        grad = torch.zeros_like(logits) if logits.shape[1] > targets.shape[1] else torch.empty_like(logits)
        R = targets.shape[1]
        # (B, 1): every term's 1 / temperature, folded into the small factors
        scale = torch.ones((logits.shape[0], 1), device=logits.device) if inv_temp is None else inv_temp.view(-1, 1)
        for s in range(0, R, ctx.chunk):
            e = min(R, s + ctx.chunk)
            ok = None if allowed is None else allowed[:, s:e]
            # what multiplies -p at each position: the sampled token's and the gathered ones' gradients
            weight = torch.zeros((logits.shape[0], e - s), dtype=torch.float32, device=logits.device)
            if g_lp is not None:
                weight = weight + g_lp[:, s:e].float()
            if g_gathered is not None:
                weight = weight + g_gathered[:, s:e].float().sum(-1)
            if g_ent is None:  # -p * weight, in place on the softmax
                g = _log_softmax(logits[:, s:e], inv_temp, ok).exp_()
                g.mul_((-weight * scale).unsqueeze(-1))
            else:  # p * (-weight - g_ent (log p + H)): one buffer, in place
                g = _log_softmax(logits[:, s:e], inv_temp, ok)
                p = g.exp()
                if ok is not None:
                    g.masked_fill_(~ok, 0.0)
                g.add_(ent[:, s:e].unsqueeze(-1)).mul_(-g_ent[:, s:e].float().unsqueeze(-1))
                g.sub_(weight.unsqueeze(-1)).mul_(p).mul_(scale.unsqueeze(-1))
                del p
            if g_lp is not None:
                g.scatter_add_(-1, targets[:, s:e].unsqueeze(-1), (g_lp[:, s:e].float() * scale).unsqueeze(-1))
            if g_gathered is not None:
                g.scatter_add_(-1, gather[:, s:e], g_gathered[:, s:e].float() * scale.unsqueeze(-1))
            if ok is not None:  # a disallowed token's logit never moved its probability (0): no gradient, as masked_fill
                g.masked_fill_(~ok, 0.0)
            grad[:, s:e] = g  # (cast to the logits' dtype)
        return grad, None, None, None, None, None, None


def token_stats(logits: torch.Tensor, temperatures: torch.Tensor, targets: torch.Tensor, *,
                allowed: torch.Tensor | None = None, gather: torch.Tensor | None = None, top_k: int = 0,
                entropy_grad: bool = False, chunk: int | None = None) -> TokenStats:
    """``logits`` (B, R', V), R' >= R, whose first R positions score the response tokens (any float
    dtype; passing the model's whole output rather than a slice of it spares the backward pass a copy:
    the positions past R get a zero gradient), each row sampled at ``temperatures`` (B,); ``targets``
    (B, R) the sampled ids; ``allowed`` (B, R, V) bool;
    ``gather`` (B, R, k) ids; ``top_k``: also the k likeliest tokens (detached). Gradients reach
    ``logits`` through the logprobs, the gathered logprobs and, with ``entropy_grad``, the entropy."""
    (B, R), V = targets.shape, logits.shape[-1]
    if logits.shape[0] != B or logits.shape[1] < R:
        raise ValueError(f"logits {tuple(logits.shape)} do not cover the targets {tuple(targets.shape)}")
    mod = train_kernels.loaded()
    if (mod is not None and allowed is None and gather is None and top_k <= 0 and logits.dtype == torch.bfloat16
            and logits.device.type == "cpu"):
        inv = 1.0 / temperatures.to(torch.float32).reshape(B)
        lp, ent = _KernelStats.apply(logits, inv, targets.to(logits.device), mod)
        return TokenStats(logprobs=lp, entropy=ent if entropy_grad else ent.detach(), gathered=None, top=None)
    chunk = chunk or _chunk_len(B, V)
    # at temperature 1 (the rows' usual case) the logits are not divided: a pass over (B, R, V) float32 spared
    inv_temp = None if bool((temperatures == 1).all()) else (1.0 / temperatures.to(logits.device, torch.float32)).view(-1, 1, 1)
    targets = targets.to(logits.device)
    allowed = None if allowed is None else allowed.to(logits.device)
    gather = None if gather is None else gather.to(logits.device)
    top = None
    if top_k > 0:  # filled by the forward's own chunks (no second log-softmax), never differentiated
        k = min(top_k, V)
        top = (torch.empty((B, R, k), dtype=torch.float32, device=logits.device),
               torch.empty((B, R, k), dtype=torch.long, device=logits.device))
    out = _Stats.apply(logits, inv_temp, targets, allowed, gather, chunk, top)
    lp, ent = out[0], out[1]
    gathered = out[2] if gather is not None else None
    return TokenStats(logprobs=lp, entropy=ent if entropy_grad else ent.detach(), gathered=gathered, top=top)
