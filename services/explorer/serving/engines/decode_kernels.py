"""The hf engine's decode step on a CPU with AVX-512 BF16: kernels of our own (``decode_kernels.cpp``).

At one to eight sequences a decode step reads every weight once and does little with it, so its
products are bound by memory bandwidth. oneDNN's bfloat16 products read SmolLM2's weights at 12-15 GB/s
there (out of ~28 that a plain sum reads on one thread), and were about three quarters of a step. The
``linear`` kernel packs each weight once so a product streams it in order, one 64-byte line per
VDPBF16PS for each row, and reads it at about 22 GB/s (docs/ENGINES.md). It accumulates in float32 and
rounds once to bfloat16, as oneDNN does; its outputs equal oneDNN's but for about one in 10,000 (the
order of the sums). Batches of more rows are compute-bound and stay on oneDNN.

The rest of the step was dozens of small torch ops a layer, each a few microseconds of dispatch on
a few kilobytes: at any batch the kernels also compute
- the attention of the new tokens over the cache buffers, read in place (``attention``: float32 sums
  of bfloat16 products, as the float32 products it replaces, without converting the cache each layer);
- the llama family's RMSNorm (``rms_norm``, and ``add_rms_norm`` with the residual sum before it: what
  the torch ops give, but its mean of squares summed in another order, so about one output in 1,000 or
  fewer rounds the other way), SiLU(gate) * up (``silu_mul``: e^-x from a polynomial, not torch's, so
  as rarely a rounding apart; below -87 it is -0) and the rotary embedding with the cache's writes
  (``rope_into_cache``, bit for bit the torch ops'). Bit for bit but for subnormal values: the
  conversion to bfloat16 flushes them to 0, where torch keeps them.

Two more calls take the rest of a step's time between kernels (2026-12-02; same bits, fewer calls):
- ``DecodeLayers`` holds the layers' packed weights and norms once and runs a step's layers in one call
  from Python (each layer's products with its adapters' terms, the rotary embedding into the cache,
  attention, norms, SiLU), where every product runs on the kernels: bit for bit what the same kernels
  give called a layer at a time, without ~15 calls from Python a layer;
- ``sample`` draws the step's tokens from its float32 logits (temperature, log-softmax, the most likely
  token at temperature 0, else the engine's two-level inverse CDF at the same u) in two passes over each
  row: torch's exp and argmax, not vectorised there, took 0.6-1.1 ms of it at 8 rows of SmolLM2's
  49,152 on one core, this about 0.1 ms. The same tokens for the same u (but a rounding at a CDF's edge)
  and log-probabilities within float32's rounding; top-p and top logprobs stay on torch.
Together, SmolLM2 bf16 on one core of a Zen 5 EPYC, paired against the calls a layer at a time and
torch's sampler: 1.05x / 1.09x / 1.08x tokens/s at 1 / 8 / 32 sequences (docs/ENGINES.md).

On a CPU with AMX (Intel Xeon from Sapphire Rapids on) the same packed weight is the layout AMX's tiles
multiply by as it is (a block's 16 pairs of inputs x 16 outputs: one 16 x 64-byte tile), so products of
``AMX_MIN_ROWS`` to ``MAX_AMX_ROWS`` rows whose inputs are a multiple of 32 run on TDPBF16PS, which does
256 multiply-adds for VDPBF16PS's 32: at 3 to 32 rows a product reads the weight at about the memory's
pace instead of waiting on the multiply-adds (SmolLM2's products, one thread: 17.5-18.5 against 22-23 ms
at 8 rows, against oneDNN's 27-34 ms at 16-32; at one row AVX-512 BF16 stays as fast, at two level). Linux
gives a process AMX's tile state only when it asks (``amx_enable``); where it refuses, the products stay
on AVX-512 BF16 and the log says so.

At 8 rows a product is bound by memory and compute together, so it asks for each block's lines 64 ahead
of its reads; the attention is compiled for the common head shapes (SmolLM2's 3 query heads a key-value
head of 64) so that its sums stay in registers. Together with the sampling's two-level inverse CDF
(``hf._inverse_cdf``) they took SmolLM2's decode at 8 sequences from 263-272 to 300-312 tokens/s on one core
(docs/ENGINES.md).

They are built the first time they are asked for (``make install`` builds them; ~35 s with the
machine's C++ compiler, cached by torch under ``TORCH_EXTENSIONS_DIR``), only on an x86 CPU with
AVX-512 BF16. Where they cannot be built or run, ``load`` says why and the step stays on oneDNN and torch.

    python -m services.explorer.serving.engines.decode_kernels    (build them now; prints whether they run here)
"""

from __future__ import annotations

import logging
import platform
from pathlib import Path
from typing import Any

import torch

from services.common import cpu_kernels
from services.common.models import cpu_flags

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_kernels.cpp")
MAX_ROWS = 8  # the products' rows; batches of more rows are compute-bound and oneDNN's products do them better
# On a CPU with AMX, products whose inputs are a multiple of 32 run on its tiles from AMX_MIN_ROWS to MAX_AMX_ROWS rows
MAX_AMX_ROWS = 32
AMX_MIN_ROWS = 3  # measured: 1 row is as fast on AVX-512 BF16, 2 level, 3 to 8 faster on AMX (docs/ENGINES.md)

NAME = "kaizen_decode_kernels"

_amx = False  # the loaded kernels' products run on AMX (amx_enable granted)


def unsupported() -> str | None:
    """Why the kernels cannot run on this machine (None: they can, once built)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"it is for x86 CPUs, this one is {platform.machine()}"
    if "avx512_bf16" not in cpu_flags():
        return "this CPU has no AVX-512 BF16"
    return None


def load() -> tuple[Any | None, str]:
    """The built kernels' module, or None and why not. Builds it on first use (one process at a time:
    torch's build lock), then it is cached for this process."""
    return _once.get()


def _build() -> tuple[Any | None, str]:
    why = unsupported()
    if why:
        return None, why
    mod, why = cpu_kernels.build(NAME, SOURCE, cflags=["-O3", "-fopenmp"], what="decode kernels")
    if mod is None:
        return None, why
    if not mod.supported():
        return None, "this CPU has no AVX-512 BF16"
    global _amx
    if {"amx_bf16", "amx_tile"} <= cpu_flags():
        _amx = bool(mod.amx_enable())  # Linux grants the tiles' state to a process that asks
        if _amx:
            mod.set_amx_min_rows(AMX_MIN_ROWS)
        else:
            log.warning("decode kernels: this CPU has AMX but Linux did not grant its tiles; products stay on AVX-512 BF16")
    return mod, ""


_once = cpu_kernels.Once(_build)


def amx() -> bool:
    """Whether the loaded kernels' products run on AMX (``AMX_MIN_ROWS`` to ``MAX_AMX_ROWS`` rows)."""
    return _amx


def max_rows(inputs: int | None = None) -> int:
    """The most rows a product of ``inputs`` inputs takes on the kernels (None: any product)."""
    return MAX_AMX_ROWS if _amx and (inputs is None or inputs % 32 == 0) else MAX_ROWS


class Packed:
    """One weight (and bias) in the kernel's layout: ``self(x)`` is ``x @ weight.T + bias`` for 1 to
    ``rows`` rows of bfloat16 ``x`` (``max_rows``)."""

    __slots__ = ("mod", "weight", "out", "inputs", "bias", "rows")

    def __init__(self, mod: Any, weight: torch.Tensor, bias: torch.Tensor | None):
        self.mod = mod
        self.out, self.inputs = weight.shape
        self.rows = max_rows(self.inputs)
        self.weight = mod.pack(weight.detach().contiguous())
        self.bias = bias.detach().float().contiguous() if bias is not None else torch.empty(0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.mod.linear(x, self.weight, self.out, self.inputs, self.bias)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    mod, why = load()
    print("decode kernels: built, they run here" if mod is not None else f"decode kernels: not used here: {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
