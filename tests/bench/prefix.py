"""`make bench` section prefix: the hf engine's prefix cache on the demo's own episodes, on and off
side by side in one process, rounds alternating.

    python -m tests.bench.run prefix     # KAIZEN_BENCH_PREFIX_EPISODES=8 KAIZEN_BENCH_PREFIX_CONCURRENCY=1,8

An episode is shaped as the demo's (services/demo/tools_task.py): SmolLM2 gets a word problem with
the calculator tool in its prompt (about 170 of the first call's tokens are the tool list), answers
(the base model, as before the demo's cold start: with a call or with text), and is called again
with the whole conversation: the first prompt, the tokens it generated, the end of its turn and a
tool's result. Both calls are greedy, at most 48 tokens each, so both sides generate the
same tokens and do the same decoding work; what differs is the prompt tokens each prefill computes.
A last row is the demo's own round: 2 problems, 8 runs of each asked at once, sampled at temperature 1,
each call from a seed of its own (both sides sample the same tokens while their logits agree; float
rounding between batch shapes can part them now and then).
The engine runs at the demo Explorer's thread count (1) in the demo's dtype (bfloat16 where the
CPU computes it natively, else float32).
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time

import torch

from services.demo import tools_task
from services.demo.tools_demo import engine_dtype
from services.explorer.serving.engines.base import GenerateRequest, SamplingParams
from services.explorer.serving.engines.hf import HFEngine
from tests.bench.common import table
from tests.bench.smollm2 import MODEL, _csv, _env_int, spread

MAX_TOKENS = 48
SIDES = ("off", "11-28", "on")
RUNS = 8  # the demo's runs of a problem (tools.traffic.repeat)
DEMO_ROUND = 0  # the demo round's key among the concurrency levels


def _prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = tools_task.make_problem(rng)
        text = tokenizer.apply_chat_template([{"role": "user", "content": p.question}], tools=tools_task.TOOLS,
                                             add_generation_prompt=True, tokenize=False)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


async def _generate(engine: HFEngine, rid: str, prompt: list[int], seed: int | None = None) -> list[int]:
    """One call, greedy; with ``seed``, sampled at temperature 1 from that seed (the same tokens on every
    side while their logits agree)."""
    params = SamplingParams(temperature=0.0 if seed is None else 1.0, max_tokens=MAX_TOKENS, seed=seed)
    req = GenerateRequest(request_id=rid, prompt_token_ids=prompt, n=1, params=params)
    ids: list[int] = []
    async for updates in engine.generate(req):
        for u in updates:
            ids += u.token_ids
    return ids


async def _episodes(engine: HFEngine, prompts: list[list[int]], tool_turn: list[int], end: int, concurrency: int,
                    seed: int | None = None) -> tuple[float, int]:
    """(seconds, prompt tokens sent) for every prompt's two-call episode, ``concurrency`` at a time (greedy;
    with ``seed``, sampled, each call from a seed of its own)."""
    sem = asyncio.Semaphore(concurrency)
    sent = 0

    async def episode(k: int, prompt: list[int]) -> None:
        nonlocal sent
        async with sem:
            first = await _generate(engine, f"e{k}-1", prompt, None if seed is None else seed * 1000 + 2 * k)
            # the conversation so far (its turn closed, as the chat template renders it), then the tool's result
            second = prompt + first + ([] if first and first[-1] == end else [end]) + tool_turn
            await _generate(engine, f"e{k}-2", second, None if seed is None else seed * 1000 + 2 * k + 1)
            sent += len(prompt) + len(second)

    t0 = time.perf_counter()
    await asyncio.gather(*(episode(k, p) for k, p in enumerate(prompts)))
    return time.perf_counter() - t0, sent


async def _run(cfg: dict) -> dict:
    engines = {}
    for side, mb, batched in (("off", 0, False), ("11-28", 256, False), ("on", 256, True)):
        e = HFEngine(model_path=cfg["model"], dtype=cfg["dtype"], device="cpu", max_batch_size=32,
                     torch_threads=cfg["threads"], prefix_cache_mb=mb, batch_own_prefixes=batched, dedupe_prompts=batched)
        await e.start()
        engines[side] = e
    tok = engines["on"].tokenizer
    tool_turn = tok.encode("\n<|im_start|>tool\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
                           add_special_tokens=False)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    results: dict = {}
    try:
        warm = _prompts(tok, 2, seed=999)
        for e in engines.values():
            await _episodes(e, warm, tool_turn, end, 2)
        for r in range(cfg["rounds"]):
            prompts = _prompts(tok, cfg["episodes"], seed=r)  # the same problems on both sides of a round
            # the demo's round: 2 problems, RUNS runs of each asked at once, sampled
            demo = [p for p in _prompts(tok, 2, seed=100 + r) for _ in range(RUNS)]
            for c in [*cfg["concurrency"], DEMO_ROUND]:
                for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                    e = engines[side]
                    reused, prefill = e._prefix.tokens_reused, e.busy_seconds["prefill"]
                    if c == DEMO_ROUND:
                        seconds, sent = await _episodes(e, demo, tool_turn, end, len(demo), seed=r)
                    else:
                        seconds, sent = await _episodes(e, prompts, tool_turn, end, c)
                    row_prefill = e.busy_seconds["prefill"] - prefill
                    row = results.setdefault((c, side), {"eps": [], "reused": [], "prefill_s": []})
                    row["eps"].append((len(demo) if c == DEMO_ROUND else len(prompts)) / seconds)
                    row["reused"].append((e._prefix.tokens_reused - reused) / sent)
                    row["prefill_s"].append(row_prefill / (len(demo) if c == DEMO_ROUND else len(prompts)))
                    await e.clear_prefix_cache()  # each round starts cold, as a fresh Explorer would
    finally:
        for e in engines.values():
            await e.shutdown()
    return results


def main() -> str:
    cfg = {"model": os.environ.get("KAIZEN_BENCH_SMOLLM2_MODEL", MODEL), "dtype": engine_dtype(),
           "threads": _env_int("KAIZEN_BENCH_PREFIX_THREADS", 1), "rounds": _env_int("KAIZEN_BENCH_ROUNDS", 3),
           "episodes": _env_int("KAIZEN_BENCH_PREFIX_EPISODES", 8),
           "concurrency": [int(c) for c in _csv("KAIZEN_BENCH_PREFIX_CONCURRENCY", "1,8")]}
    if not os.path.exists(os.path.join(cfg["model"], "config.json")):
        return f"== prefix: skipped, no model at {cfg['model']} (make pretrained)"
    torch.manual_seed(0)
    results = asyncio.run(_run(cfg))
    rows = []
    for c in [*cfg["concurrency"], DEMO_ROUND]:
        off, alone, on = (results[(c, side)] for side in SIDES)
        rows.append([c if c != DEMO_ROUND else f"{2 * RUNS}: the demo's round (2 problems x {RUNS} runs, sampled)", spread(off["eps"], "{:.2f}"), spread(alone["eps"], "{:.2f}"), spread(on["eps"], "{:.2f}"),
                     spread([b / a for a, b in zip(off["eps"], on["eps"])], "{:.2f}"),
                     spread([b / a for a, b in zip(alone["eps"], on["eps"])], "{:.2f}"),
                     " / ".join(f"{statistics.median(results[(c, side)]['prefill_s']) * 1e3:.0f}" for side in SIDES),
                     f"{statistics.median(on['reused']):.0%}"])
    title = (f"prefix: the hf engine's prefix cache on the demo's two-call episodes (SmolLM2, {cfg['dtype']}, "
            f"{cfg['threads']} thread(s), {cfg['episodes']} episodes per round, greedy, <= {MAX_TOKENS} tokens a call); "
            f"off: no cache (nor one computation of identical prompts); 11-28: the cache as it was then, each next call prefilled on its own and identical prompts "
            f"each computed; on: next calls admitted together prefilled in one batch, each on its own conversation, and "
            f"identical prompts admitted together computed once (the default); median (min..max) of {cfg['rounds']} "
            f"rounds, sides alternating")
    return table(title, ["concurrency", "episodes/s off", "11-28", "on", "on / off", "on / 11-28",
                         "prefill ms an episode off / 11-28 / on", "prompt tokens reused"], rows)


if __name__ == "__main__":
    print(main())
