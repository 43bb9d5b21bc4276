"""`make bench` section engine-replicas: the demo's rounds of traffic on one hf engine against two
(`engine.replicas: 2`, one thread each), side by side in one process, rounds alternating.

    python -m tests.bench.run engine-replicas      # KAIZEN_BENCH_ENGINE_REPLICAS_ROUNDS=4 (rounds of each side)

A round is the demo's (tests/bench/prefix.py): 2 problems, 8 runs of each asked at once, each run a
two-call episode (the calculator call, then the answer after the tool's result), sampled at
temperature 1 from a seed of its own, in the demo's dtype. Sides:
  - one: one engine on one thread (the demo's Explorer before 2026-11-30);
  - one, 2 threads: one engine on two threads;
  - two: two engines on one thread each, a call that continues a conversation sent to the replica that
    served it (the default routing);
  - two, next call elsewhere: the same two, each next call sent to the other replica (what the routing
    by conversation saves: that call's conversation is prefilled again there).
Printed: episodes a second (median and range over the rounds) and each side's ratio to "one", paired
by round. On a 2-core machine the two replicas are what the demo's Explorer runs (one a core).
"""

from __future__ import annotations

import asyncio
import os

import torch

from services.demo.tools_demo import engine_dtype
from services.explorer.serving.engines.hf import HFEngine
from services.explorer.serving.engines.replicas import ReplicatedEngine
from tests.bench.common import table
from tests.bench.prefix import RUNS, _episodes, _prompts
from tests.bench.smollm2 import MODEL, _env_int, spread

SIDES = ("one", "one, 2 threads", "two", "two, next call elsewhere")


class _Elsewhere(ReplicatedEngine):
    """Two replicas whose next call of a conversation always goes to the replica that did not serve it."""

    def _pick(self, prompt: bytes | None = None) -> int:
        same = self._continued(prompt) if prompt is not None else None
        return super()._pick(prompt) if same is None else 1 - same


def _engine(cfg: dict, threads: int) -> HFEngine:
    return HFEngine(model_path=cfg["model"], dtype=cfg["dtype"], device="cpu", max_batch_size=32, torch_threads=threads)


async def _run(cfg: dict) -> dict[str, list[float]]:
    engines = {"one": _engine(cfg, 1), "one, 2 threads": _engine(cfg, 2)}
    pair = [_engine(cfg, 1), _engine(cfg, 1)]
    for e in [*engines.values(), *pair]:
        await e.start()
    engines["two"], engines["two, next call elsewhere"] = ReplicatedEngine(pair), _Elsewhere(pair)
    for side in ("two", "two, next call elsewhere"):
        engines[side].tokenizer, engines[side].max_model_len = pair[0].tokenizer, pair[0].max_model_len
    tok = pair[0].tokenizer
    tool_turn = tok.encode("\n<|im_start|>tool\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
                           add_special_tokens=False)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    eps: dict[str, list[float]] = {side: [] for side in SIDES}
    try:
        warm = [p for p in _prompts(tok, 2, seed=999) for _ in range(RUNS)]
        for side in SIDES:
            await _episodes(engines[side], warm, tool_turn, end, len(warm), seed=999)
        for r in range(cfg["rounds"]):
            demo = [p for p in _prompts(tok, 2, seed=100 + r) for _ in range(RUNS)]
            for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                seconds, _ = await _episodes(engines[side], demo, tool_turn, end, len(demo), seed=r)
                eps[side].append(len(demo) / seconds)
                for e in (pair if side.startswith("two") else [engines[side]]):
                    await e.clear_prefix_cache()  # each round starts cold, as a fresh Explorer would
    finally:
        for e in [engines["one"], engines["one, 2 threads"], *pair]:
            await e.shutdown()
    return eps


def main() -> str:
    cfg = {"model": os.environ.get("KAIZEN_BENCH_SMOLLM2_MODEL", MODEL), "dtype": engine_dtype(),
           "rounds": _env_int("KAIZEN_BENCH_ENGINE_REPLICAS_ROUNDS", 4)}
    if not os.path.exists(os.path.join(cfg["model"], "config.json")):
        return f"== engine-replicas: skipped, no model at {cfg['model']} (make pretrained)"
    torch.manual_seed(0)
    eps = asyncio.run(_run(cfg))
    rows = [[side, spread(eps[side], "{:.2f}"), spread([b / a for a, b in zip(eps["one"], eps[side])], "{:.2f}")]
            for side in SIDES]
    title = (f"engine-replicas: the demo's round ({2 * RUNS} two-call episodes at once, SmolLM2, {cfg['dtype']}, sampled) "
             f"on one hf engine against two (engine.replicas: 2), on {os.cpu_count()} CPUs; median (min..max) of "
             f"{cfg['rounds']} rounds, sides alternating; ratios paired by round")
    return table(title, ["side", "episodes/s", "/ one"], rows)


if __name__ == "__main__":
    print(main())
