"""An adapted linear layer's forward and backward as a few products in the weights' dtype.

peft computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling`` as separate operations: under
autocast (bfloat16 weights, float32 LoRA: the Trainer on a CPU) the LoRA product writes a whole
(tokens x out) tensor, the scaling a second, the sum a third, and the backward retraces each. On a
2-core CPU those passes over memory cost more than the rank-16 products themselves.

``LoraProducts`` does the same arithmetic in two products a direction, accumulating in place:

    forward   y  = x W^T (+ bias);  y += scaling * (x A^T) B^T
    backward  gx = g W;  gx += scaling * (g B) A;  gB = scaling * g^T (x A^T);  gA = scaling * (g B)^T x

with A and B cast to the weights' dtype once per forward (as autocast would), their gradients
returned in float32 (their own dtype). ``fuse_lora_layers`` gives each of a peft model's LoRA
linear layers this forward wherever it applies (one active plain adapter, no dropout, not merged,
the base frozen); anything else goes through peft's own forward unchanged.
"""

from __future__ import annotations

import torch
from torch import nn


class LoraProducts(torch.autograd.Function):
    """``x W^T + bias + scaling (x A^T) B^T``, W and bias frozen, in W's dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
        dtype = weight.dtype
        a, b = lora_a.to(dtype), lora_b.to(dtype)
        rows = x.reshape(-1, x.shape[-1]).to(dtype)
        xa = rows @ a.t()
        y = rows @ weight.t() if bias is None else torch.addmm(bias.to(dtype), rows, weight.t())
        y.addmm_(xa, b.t(), alpha=scaling)
        ctx.save_for_backward(rows, xa, weight, a, b)
        ctx.scaling, ctx.in_shape, ctx.in_dtype = scaling, x.shape, x.dtype
        ctx.ab_dtypes = (lora_a.dtype, lora_b.dtype)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, xa, weight, a, b = ctx.saved_tensors
        s = ctx.scaling
        g = grad.reshape(-1, grad.shape[-1]).to(weight.dtype)
        gb_in = (g @ b).mul_(s)  # (tokens, r): the gradient at B's input, scaled
        gx = None
        if ctx.needs_input_grad[0]:
            gx = (g @ weight).addmm_(gb_in, a).view(ctx.in_shape).to(ctx.in_dtype)
        ga = (gb_in.t() @ rows).to(ctx.ab_dtypes[0]) if ctx.needs_input_grad[3] else None
        gb = (g.t() @ xa).mul_(s).to(ctx.ab_dtypes[1]) if ctx.needs_input_grad[4] else None
        return gx, None, None, ga, gb, None


def _products_apply(layer, x: torch.Tensor, args: tuple, kwargs: dict) -> tuple | None:
    """(weight, bias, A, B, scaling) when ``layer``'s forward on ``x`` is plain LoRA on a frozen base; else None."""
    if args or kwargs or layer.disable_adapters or layer.merged:
        return None
    active = [n for n in layer.active_adapters if n in layer.lora_A]
    if len(active) != 1:
        return None
    name = active[0]
    base, lora_a, lora_b = layer.get_base_layer(), layer.lora_A[name], layer.lora_B[name]
    if (name in layer.lora_variant or type(base) is not nn.Linear
            or not isinstance(layer.lora_dropout[name], nn.Identity) or lora_b.bias is not None
            or base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad)
            or base.weight.dtype not in (torch.bfloat16, torch.float16, torch.float32) or not x.is_floating_point()):
        return None
    if lora_a.weight.dtype != base.weight.dtype and getattr(layer, "cast_input_dtype_enabled", True):
        return None  # peft computes the LoRA term in the adapter's dtype here (no autocast): its own forward does
    return base.weight, base.bias, lora_a.weight, lora_b.weight, float(layer.scaling[name])


_FUSED: dict[type, type] = {}


def _fused_class(cls: type) -> type:
    """A subclass of peft's LoRA linear ``cls`` whose forward takes ``LoraProducts`` where it applies."""
    if cls not in _FUSED:
        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            parts = _products_apply(self, x, args, kwargs)
            if parts is None:
                return cls.forward(self, x, *args, **kwargs)
            return LoraProducts.apply(x, *parts)

        _FUSED[cls] = type(cls.__name__, (cls,), {"forward": forward, "__module__": __name__})
    return _FUSED[cls]


def fuse_lora_layers(model: nn.Module) -> int:
    """Give every peft LoRA linear layer of ``model`` the fused forward; returns how many layers it has now."""
    from peft.tuners.lora.layer import Linear

    count = 0
    for module in model.modules():
        if type(module) is Linear:
            module.__class__ = _fused_class(Linear)
        if type(module) in _FUSED.values():
            count += 1
    return count
