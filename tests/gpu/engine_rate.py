"""The hf engine's decode rate on a GPU, by hand (CI has no GPU): a model of SmolLM2-135M's shape (random
bfloat16 weights, no model hub; trainer_mfu.py's), c requests at once of a 256-token prompt and 256 sampled
tokens each (end of sequence ignored), against transformers' own ``generate`` on the same model and batch,
one after the other in one process. vLLM is not on the lent machines; its row stays empty.

    OUT=/tmp/out python tests/gpu/engine_rate.py [--concurrency 1 8 32 64] [--rounds 3]

Prints one JSON line per concurrency and writes $OUT/engine_rate.json: tokens/s of each (the median round,
and every round), the engine's over generate's, and the bandwidth roofline (a decode step reads the weights
once and every sequence's keys and values: bandwidth x batch / those bytes) at the copy bandwidth measured here.
"""
import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from tests.gpu.trainer_mfu import shaped_model  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, gib: float = 2.0) -> float:
    """Bytes read and written a second by a copy on the device (the roofline's bandwidth)."""
    x = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(device)
    return 2 * x.numel() * 10 / (time.perf_counter() - t0)


async def engine_round(engine, prompts: list[list[int]], tokens: int, seed: int) -> float:
    from services.explorer.serving.engines.base import GenerateRequest, SamplingParams

    async def one(i: int, p: list[int]) -> int:
        req = GenerateRequest(request_id=f"r{seed}-{i}", prompt_token_ids=p,
                              params=SamplingParams(max_tokens=tokens, seed=seed * 1000 + i))
        n = 0
        async for ups in engine.generate(req):
            n += sum(len(u.token_ids) for u in ups)
        return n

    t0 = time.perf_counter()
    n = sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    return n / (time.perf_counter() - t0)


def generate_round(model, prompts: list[list[int]], tokens: int, device: str) -> float:
    ids = torch.tensor(prompts, device=device)
    sync(device)
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=tokens,
                         min_new_tokens=tokens, top_k=0, pad_token_id=0)
    sync(device)
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / (time.perf_counter() - t0)


def main() -> list[dict]:
    p = argparse.ArgumentParser()
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=30, help="fewer: a quick check of the script on a CPU")
    a = p.parse_args()
    from transformers import AutoModelForCausalLM

    from services.explorer.serving.engines.hf import HFEngine

    path, params = shaped_model(a.layers)
    bandwidth = copy_bandwidth(a.device, 2.0 if a.device == "cuda" else 0.25)
    # a decode step reads the weights once and each sequence's keys and values (on average half the new tokens in)
    with open(os.path.join(path, "config.json")) as f:
        mc = json.load(f)
    kv_per_token = 2 * mc["num_hidden_layers"] * mc["num_key_value_heads"] * mc["hidden_size"] // mc["num_attention_heads"] * 2
    rng = random.Random(0)
    engine = HFEngine(model_path=path, dtype="bfloat16", device=a.device, max_batch_size=max(a.concurrency),
                      max_model_len=a.prompt + a.tokens + 8, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(a.device).eval()
    rows = []

    async def run():
        await engine.start()
        engine._eos = set()  # every request samples all its tokens, as generate's min_new_tokens makes it
        try:
            await engine_round(engine, [[rng.randrange(100, 49000) for _ in range(a.prompt)] for _ in range(4)], 16, 999)
            generate_round(model, [[rng.randrange(100, 49000) for _ in range(a.prompt)] for _ in range(4)], 16, a.device)
            for c in a.concurrency:
                ours, theirs = [], []
                for r in range(a.rounds):  # alternating, each round on fresh prompts
                    prompts = [[rng.randrange(100, 49000) for _ in range(a.prompt)] for _ in range(c)]
                    ours.append(await engine_round(engine, prompts, a.tokens, r))
                    theirs.append(generate_round(model, prompts, a.tokens, a.device))
                step_bytes = 2 * params + c * (a.prompt + a.tokens / 2) * kv_per_token
                row = {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu", "concurrency": c, "engine_tokens_per_s": statistics.median(ours),
                       "generate_tokens_per_s": statistics.median(theirs), "engine_rounds": ours, "generate_rounds": theirs,
                       "engine_over_generate": statistics.median(o / t for o, t in zip(ours, theirs)),
                       "roofline_tokens_per_s": bandwidth * c / step_bytes, "copy_bandwidth_gb_s": bandwidth / 1e9}
                row["engine_share_of_roofline"] = row["engine_tokens_per_s"] / row["roofline_tokens_per_s"]
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            await engine.shutdown()

    asyncio.run(run())
    os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp/out"), "engine_rate.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
