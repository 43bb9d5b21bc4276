"""The decode products at 1-8 rows on a CPU with AVX-512 BF16: a kernel of our own (``gemv.cpp``).

At one to eight sequences a decode step reads every weight once and does little with it, so its
products are bound by memory bandwidth. oneDNN's bfloat16 products read SmolLM2's weights at 12-15 GB/s
there (out of ~30 that a plain sum reads), so they were about three quarters of a step. This kernel
packs each weight once so a product streams it in order, one 64-byte line per VDPBF16PS for each row,
and reads them at 22-27 GB/s (docs/ENGINES.md). It accumulates in float32 and rounds once to bfloat16,
as oneDNN does; its outputs equal oneDNN's but for about one in 10,000 (the order of the sums).

It is built the first time it is asked for (``make install`` builds it; ~35 s with the machine's
C++ compiler, cached by torch under ``TORCH_EXTENSIONS_DIR``) and only on an x86 CPU with AVX-512 BF16.
Where it cannot be built or run, ``load`` says why and the engine keeps oneDNN's products.

    python -m services.explorer.serving.engines.gemv      (build it now; prints whether it runs here)
"""

from __future__ import annotations

import logging
import platform
import threading
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gemv.cpp")
MAX_ROWS = 8  # the kernel's rows; batches of more rows are compute-bound and oneDNN's products do them better

_lock = threading.Lock()
_loaded: tuple[Any, str] | None = None


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


def unsupported() -> str | None:
    """Why the kernel cannot run on this machine (None: it can, once built)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"it is for x86 CPUs, this one is {platform.machine()}"
    if "avx512_bf16" not in cpu_flags():
        return "this CPU has no AVX-512 BF16"
    return None


def load() -> tuple[Any | None, str]:
    """The built kernel module, or None and why not. Builds it on first use (one process at a time:
    torch's build lock), then it is cached for this process."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _build()
        return _loaded


def _build() -> tuple[Any | None, str]:
    why = unsupported()
    if why:
        return None, why
    try:
        from torch.utils.cpp_extension import load as load_extension

        mod = load_extension(name="kaizen_gemv", sources=[str(SOURCE)], extra_cflags=["-O3", "-fopenmp"],
                             extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: oneDNN's products still run
        first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        log.warning("gemv kernel: not built (%s: %s); decode products stay on oneDNN", type(e).__name__, first)
        return None, f"it could not be built ({type(e).__name__}: {first[:300]})"
    if not mod.supported():
        return None, "this CPU has no AVX-512 BF16"
    return mod, ""


class Packed:
    """One weight (and bias) in the kernel's layout: ``self(x)`` is ``x @ weight.T + bias`` for 1 to
    ``MAX_ROWS`` rows of bfloat16 ``x``."""

    __slots__ = ("mod", "weight", "out", "bias")

    def __init__(self, mod: Any, weight: torch.Tensor, bias: torch.Tensor | None):
        self.mod = mod
        self.out = weight.shape[0]
        self.weight = mod.pack(weight.detach().contiguous())
        self.bias = bias.detach().float().contiguous() if bias is not None else torch.empty(0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.mod.linear(x, self.weight, self.out, self.bias)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    mod, why = load()
    print("gemv kernel: built, runs here" if mod is not None else f"gemv kernel: not used here: {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
