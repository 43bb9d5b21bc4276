"""Loading the base model the same way in every service: device and dtype, weights, and the
tokenizer with the configured chat template (so prompt ids agree between Explorer and Trainer), and
the prompt prefix a batch shares (both services compute it once)."""

from __future__ import annotations

from typing import Any, Sequence

import torch


class ModelLoadError(RuntimeError):
    """model.path cannot be loaded; the message says how to get a model there."""


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cpu_flags() -> set[str]:
    """This CPU's feature flags as Linux lists them (empty where /proc/cpuinfo cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 in hardware (AVX-512 BF16 or AMX). Without it, torch
    emulates bfloat16 matmuls and they run several times slower than float32 (measured 8x on an
    AVX2-only EPYC: 9.8 against 74.5 GFLOP/s on one core)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


_BF16_SPEEDUP: list[float] = []


def bf16_products_speedup() -> float:
    """How many times faster this CPU multiplies matrices in bfloat16 than in float32, measured once a
    process at its torch threads (a 512 x 1024 x 1024 product, best of 3 after a warm-up: about 0.1 s).

    The flags do not say it: AMX makes bfloat16 products 6-9x float32's; AVX-512 BF16 alone (a Xeon
    whose AMX the hypervisor hides) made them 0.56x (146 against 261 GFLOP/s on 2 cores), so a
    Trainer step in bfloat16 took 1.4x as long as in float32 there. 0 where the CPU lacks native
    bfloat16 (emulated: several times slower; not measured)."""
    if not _BF16_SPEEDUP:
        _BF16_SPEEDUP.append(_measure_bf16_speedup() if cpu_has_native_bf16() else 0.0)
    return _BF16_SPEEDUP[0]


def _measure_bf16_speedup() -> float:
    import time

    best = {}
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator().manual_seed(0)
            a = torch.randn(512, 1024, generator=gen).to(dtype)
            b = torch.randn(1024, 1024, generator=gen).to(dtype)
            times = []
            for _ in range(4):  # the first call builds oneDNN's kernel: not counted
                t = time.perf_counter()
                a @ b
                times.append(time.perf_counter() - t)
            best[dtype] = min(times[1:])
    return best[torch.float32] / best[torch.bfloat16]


def cpu_training_dtype() -> str:
    """The faster dtype for training on this CPU: bfloat16 where its products run at least as fast
    as float32's (``bf16_products_speedup``), else float32. A step's other passes over memory halve
    in bfloat16 too, but not enough to make up products slower than float32's (measured: 0.56x
    products made a step 0.72x)."""
    return "bfloat16" if bf16_products_speedup() >= 1.0 else "float32"


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: use auto, float32, bfloat16 or float16") from None


def load_base_model(path: str, *, dtype: torch.dtype, device: torch.device, chat_template: str | None = None) -> tuple[Any, Any]:
    """(tokenizer, causal LM on ``device``) from a local directory or hub id."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from services.common.chat_templates import load_tokenizer

    hf_logging.disable_progress_bar()
    try:
        tokenizer = load_tokenizer(path, chat_template)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except OSError as e:
        raise ModelLoadError(
            f"cannot load model.path {path!r}: {e}. For the local tiny model run `kaizen tiny-model {path}`; for "
            f"a real one `kaizen pretrained smollm2-135m-instruct {path}`."
        ) from e
    return tokenizer, model.to(device)


def stop_token_ids(tokenizer: Any, model: Any) -> set[int]:
    """Tokens that end a response: the generation config's EOS ids and the tokenizer's."""
    gen = getattr(model, "generation_config", None)
    eos = gen.eos_token_id if gen is not None else None
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def shared_prefix_len(prompts: Sequence[Sequence[int]]) -> int:
    """How many leading tokens every prompt has in common, leaving each at least one of its own
    (the logits that score a response's first token come from the prompt's last position)."""
    first = prompts[0]
    n = min(len(p) for p in prompts) - 1
    for p in prompts[1:]:
        k = 0
        while k < n and p[k] == first[k]:
            k += 1
        n = k
    return max(n, 0)
