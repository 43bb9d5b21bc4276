"""The Trainer's kernels for bfloat16 on a CPU (``train_kernels.cpp``): RMSNorm, and the response tokens' statistics.

transformers' llama RMSNorm is eight torch ops (a float32 copy, its square, mean, rsqrt, product, the
copy back, the weight's product) and autograd retraces each backward. A step of SmolLM2 in bfloat16 on
a 2-core Xeon with AMX took ~1.95 s, of which those norms' passes over memory were ~0.18 s (measured
by swapping each norm for a single product). ``rms_norm_forward`` / ``_backward`` compute the same
values with the same roundings in one pass over a row each way: 0.28 ms against 1.35-1.67 ms for a
norm of 664 rows of 576, keeping for the backward the norm's input and one float32 a row.

``token_stats_forward`` / ``_backward`` give each sampled token's logprob and each position's entropy
from the LM head's bfloat16 logits in two passes over a position's logits forward and one backward,
where the chunked torch path (``token_stats.py``, which takes them where the process has loaded these
kernels) made float32 copies: 21 against 94 ms for 243 positions of SmolLM2's 49,152.

(SiLU(gate) * up was tried the same way and left on torch: a fused forward and backward in plain C++,
vectorised for AVX2, was slower than torch's AVX-512 ops on that Xeon, 1.5 against 1.2 ms.)

``fuse_norms`` gives a model's norms the kernel's forward where the norm's class computes what
llama's does (its ``forward`` is llama's line for line, as transformers copies it between models:
Qwen2/3, Mistral, ...) and runs in bfloat16 on the CPU with a frozen weight; anything else runs the
model's own forward. The kernels are built on first use (``services/common/cpu_kernels.py``) on an
x86 CPU with AVX2 and FMA; elsewhere ``load`` says why and the Trainer keeps transformers' ops.

    python -m services.trainer.train_kernels    (build them now; prints whether they run here)
"""

from __future__ import annotations

import inspect
import logging
import platform
from pathlib import Path
from typing import Any

import torch
from torch import nn

from services.common import cpu_kernels
from services.common.models import cpu_flags

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("train_kernels.cpp")
NAME = "kaizen_train_kernels"

def unsupported() -> str | None:
    """Why the kernels cannot run on this machine (None: they can, once built)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"they are built for x86 CPUs, this one is {platform.machine()}"
    missing = {"avx2", "fma"} - cpu_flags()
    return f"this CPU has no {' or '.join(sorted(missing))}" if missing else None


def _build() -> tuple[Any | None, str]:
    why = unsupported()
    if why:
        return None, why
    return cpu_kernels.build(NAME, SOURCE, cflags=["-O3", "-mavx2", "-mfma", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"],
                             what="Trainer kernels")


_once = cpu_kernels.Once(_build)


def load() -> tuple[Any | None, str]:
    """The built kernels' module, or None and why not; built on first use, then cached for the process."""
    return _once.get()


def loaded() -> Any | None:
    """The kernels' module if this process has loaded it already (a Policy in bfloat16 on the CPU does), else
    None: never builds."""
    return _once.peek()


class RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, mod: Any) -> torch.Tensor:
        y, rstd = mod.rms_norm_forward(x, weight, eps)
        ctx.mod = mod
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        return ctx.mod.rms_norm_backward(grad.to(x.dtype), x, weight, rstd), None, None, None


def _bf16_cpu(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in ts)


def norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """A llama RMSNorm's forward: on the kernel for bfloat16 on the CPU with a frozen weight, else its own."""
    if _bf16_cpu(hidden_states, self.weight) and not self.weight.requires_grad:
        return RmsNorm.apply(hidden_states, self.weight, float(self.variance_epsilon), _once.peek())
    return type(self).__mro__[1].forward(self, hidden_states)


def _source(fn) -> str | None:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return None


_SUBCLASSES: dict[type, type] = {}


def _swap(module: nn.Module, forward) -> None:
    cls = type(module)
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(cls.__name__, (cls,), {"forward": forward, "__module__": __name__})
    module.__class__ = _SUBCLASSES[cls]


def fuse_norms(model: nn.Module) -> tuple[int, str]:
    """Give ``model``'s llama-form RMSNorms the kernel's forward: (how many it has now, why none: empty when the
    kernel loads)."""
    mod, why = load()
    if mod is None:
        return 0, why
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    llama = _source(LlamaRMSNorm.forward)
    count = 0
    for module in model.modules():
        cls = type(module)
        if cls not in _SUBCLASSES.values() and hasattr(module, "variance_epsilon") and _source(cls.forward) == llama:
            _swap(module, norm_forward)
        count += type(module) in _SUBCLASSES.values()
    return count, ""


def main() -> int:
    mod, why = load()
    print("Trainer kernels (RMSNorm, token statistics):", "built and run here" if mod is not None else f"not used: {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
