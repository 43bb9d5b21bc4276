"""The Trainer's per-token statistics on a GPU, by hand (CI has no GPU): the plain computation (upcast,
temperature, log-softmax, exp; tests/bench/logits.py) against token_stats' chunks, side by side in one
process, rounds alternating, at a few chunk sizes (token_stats.CHUNK_ELEMENTS was chosen on a CPU).

    OUT=/tmp/out python tests/gpu/logits_cuda.py [--shapes 8x2048 32x512] [--dtype bfloat16]

Each round: SmolLM2-135M's LM head (576 -> 49,152) on hidden states of the shape, the statistics, a
loss on the logprobs and the entropy, backward to the hidden states. Time: the median of the measured
rounds (after a warm-up) with CUDA synchronised; peak: the allocator's peak above the round's start.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.getcwd())

from services.trainer import token_stats as ts  # noqa: E402
from tests.bench.logits import HIDDEN, VOCAB, plain_token_stats  # noqa: E402


def one_round(kind: str, rows: int, length: int, dtype: torch.dtype, seed: int, dev: str) -> tuple[float, float, float]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) * HIDDEN**-0.5).to(dev, dtype)
    hidden = torch.randn(rows, length, HIDDEN, generator=g).to(dev, dtype).requires_grad_(True)
    targets = torch.randint(0, VOCAB, (rows, length), generator=g).to(dev)
    temps = torch.full((rows,), 0.7, device=dev)
    adv = torch.randn(rows, length, generator=g).to(dev)
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated() if dev == "cuda" else 0
    t0 = time.perf_counter()
    logits = hidden @ weight.T
    if kind == "plain":
        lp, ent, _, _ = plain_token_stats(logits, temps, targets)
    else:
        s = ts.token_stats(logits, temps, targets, entropy_grad=True)
        lp, ent = s.logprobs, s.entropy
    loss = -(lp * adv).mean() - 0.01 * ent.mean()
    loss.backward()
    if dev == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - start) if dev == "cuda" else 0
    return seconds, peak, float(hidden.grad.float().abs().sum())


def main() -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["8x2048", "32x512", "64x512"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chunks", nargs="+", type=int, default=[22, 24, 26], help="log2 of CHUNK_ELEMENTS to try")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    kinds = ["plain"] + [f"chunked-2^{c}" for c in a.chunks]
    out = {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu", "dtype": a.dtype, "shapes": {}}
    for shape in a.shapes:
        rows, length = (int(x) for x in shape.split("x"))
        res: dict[str, list[tuple[float, float, float]]] = {k: [] for k in kinds}
        for r in range(a.rounds + 1):
            order = kinds if r % 2 == 0 else kinds[::-1]
            for kind in order:
                if kind != "plain":
                    ts.CHUNK_ELEMENTS = 1 << int(kind.split("^")[1])
                res[kind].append(one_round("plain" if kind == "plain" else "chunked", rows, length, dtype, r, a.device))
        row = {}
        for kind, xs in res.items():
            grads_ok = all(abs(x[2] - y[2]) <= 2e-2 * abs(y[2]) for x, y in zip(xs, res["plain"]))
            xs = xs[1:]
            row[kind] = {"ms_median": statistics.median(x[0] for x in xs) * 1e3,
                         "ms_range": [min(x[0] for x in xs) * 1e3, max(x[0] for x in xs) * 1e3],
                         "peak_gib": statistics.median(x[1] for x in xs) / 2**30, "same_grad_as_plain": grads_ok}
        out["shapes"][shape] = row
        print(shape, json.dumps(row), flush=True)
    os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp/out"), "logits_cuda.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
