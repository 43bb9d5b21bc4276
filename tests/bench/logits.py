"""`make bench` section logits: the Trainer's per-token statistics (logprobs of the sampled tokens and
the entropy, with its gradient) from SmolLM2-sized logits, computed plainly (upcast, divide by the
temperature, log-softmax, exp: what the Trainer did before), chunk by chunk in torch
(services/trainer/token_stats.py) and, in bfloat16 where the Trainer's kernels build, on them
(services/trainer/train_kernels.cpp: what a Policy in bfloat16 on a CPU runs), side by side in one
process, rounds rotating.

    python -m tests.bench.logits        # KAIZEN_BENCH_LOGITS="4x1024" (rows x response tokens)

Each round: the LM head (576 -> 49,152, SmolLM2-135M's) on hidden states of the given shape, the
statistics, a loss on both, backward to the hidden states and the head. Peak = the process's peak
resident memory during the round less its resident memory before it (VmHWM, reset each round).
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from tests.bench.common import table
from tests.bench.smollm2 import _peak_rss, _release_memory, _reset_peak_rss

HIDDEN, VOCAB = 576, 49_152


def plain_token_stats(logits, temps, targets, allowed=None, gather=None, top_k=0):
    """The statistics as the Trainer computed them before token_stats: (logprobs, entropy, gathered,
    top), every (B, R, V) intermediate kept by autograd. The reference the tests compare against."""
    z = logits.float() / temps.view(-1, 1, 1)
    if allowed is not None:
        z = z.masked_fill(~allowed, float("-inf"))
    logp = torch.log_softmax(z, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    finite = logp if allowed is None else logp.masked_fill(~allowed, 0.0)
    ent = -(logp.exp() * finite).sum(-1)
    gathered = None if gather is None else logp.gather(-1, gather)
    top = logp.detach().topk(top_k, dim=-1) if top_k else None
    return lp, ent, gathered, top


def _rss() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _round(kind: str, rows: int, length: int, dtype: torch.dtype, seed: int) -> tuple[float, float, float]:
    """(seconds, peak bytes above the start, loss) of one forward and backward."""
    from services.trainer import train_kernels
    from services.trainer.token_stats import token_stats

    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g) * HIDDEN**-0.5)
    head = head.to(dtype)
    hidden = torch.randn(rows, length, HIDDEN, generator=g).to(dtype).requires_grad_(True)
    targets = torch.randint(0, VOCAB, (rows, length), generator=g)
    temps = torch.full((rows,), 0.7)
    adv = torch.randn(rows, length, generator=g)
    _release_memory()
    _reset_peak_rss()
    start = _rss()
    t0 = time.perf_counter()
    logits = head(hidden)
    if kind == "plain":
        lp, ent, _, _ = plain_token_stats(logits, temps, targets)
    else:  # token_stats takes the kernels where the process loaded them: here only on the kernel side
        real = train_kernels.loaded
        train_kernels.loaded = (lambda: train_kernels.load()[0]) if kind == "kernel" else (lambda: None)
        try:
            s = token_stats(logits, temps, targets, entropy_grad=True)
        finally:
            train_kernels.loaded = real
        lp, ent = s.logprobs, s.entropy
    loss = -(lp * adv).mean() - 0.01 * ent.mean()
    loss.backward()
    seconds = time.perf_counter() - t0
    peak = _peak_rss() - start
    del logits, lp, ent, loss
    return seconds, peak, float(hidden.grad.float().abs().sum())


def main() -> str:
    rows, length = (int(x) for x in os.environ.get("KAIZEN_BENCH_LOGITS", "4x1024").split("x"))
    dtypes = [torch.float32] + ([torch.bfloat16] if "avx512_bf16" in open("/proc/cpuinfo").read() else [])
    torch.set_num_threads(os.cpu_count() or 1)
    from services.trainer import train_kernels

    kernels, why = train_kernels.load()
    out = []
    for dtype in dtypes:
        sides = ["plain", "chunked"] + (["kernel"] if dtype == torch.bfloat16 and kernels is not None else [])
        res: dict[str, list[tuple[float, float, float]]] = {k: [] for k in sides}
        for r in range(4):
            for kind in sides[r % len(sides):] + sides[: r % len(sides)]:
                res[kind].append(_round(kind, rows, length, dtype, seed=r))
        grads = {k: [x[2] for x in v] for k, v in res.items()}
        same = all(abs(a - b) <= 1e-3 * abs(a) for k in sides[1:] for a, b in zip(grads["plain"], grads[k]))
        rows_out = []
        for kind, xs in res.items():
            xs = xs[1:]  # the first round warms the allocator and the kernels
            secs, peaks = [x[0] for x in xs], [x[1] for x in xs]
            rows_out.append([str(dtype).removeprefix("torch."), kind, f"{statistics.median(secs) * 1e3:.0f}",
                             f"{min(secs) * 1e3:.0f}-{max(secs) * 1e3:.0f}", f"{statistics.median(peaks) / 2**30:.2f}"])
        p, c = ([x for x in res[k][1:]] for k in ("plain", "chunked"))
        ratio_t = statistics.median(a[0] for a in c) / statistics.median(a[0] for a in p)
        ratio_m = statistics.median(a[1] for a in c) / statistics.median(a[1] for a in p)
        rows_out.append(["", "chunked / plain", f"{ratio_t:.2f}x", "", f"{ratio_m:.2f}x"])
        if "kernel" in res:
            k = res["kernel"][1:]
            rows_out.append(["", "kernel / chunked", f"{statistics.median(a[0] for a in k) / statistics.median(a[0] for a in c):.2f}x",
                             "", f"{statistics.median(a[1] for a in k) / statistics.median(a[1] for a in c):.2f}x"])
        out.append(table(f"logits: per-token statistics of {rows} x {length} response tokens, vocabulary {VOCAB:,} "
                         f"({'same' if same else 'DIFFERENT'} gradients)",
                         ["dtype", "side", "ms (median)", "range", "peak GiB"], rows_out))
    note = "" if kernels is not None else f"; the Trainer's kernels do not run here ({why})"
    return "\n".join(out) + f"\n(3 measured rounds each after a warm-up round, rotating; peak = VmHWM above the round's start{note})"


if __name__ == "__main__":
    print(main())
