"""Explorer throughput vs the bare engine, and the buffer's sustained write rate.

    python -m tests.bench.explorer

The same HFEngine (one torch thread) is driven at concurrency 1, 8 and 32: in-process without HTTP
or recording ("bare"), through a real `kaizen explorer` subprocess over HTTP with everything
recorded, and through a second one with recorder.enabled=false (to isolate what recording itself
costs). Rounds interleave all three so machine drift hits each the same.

Two models: the tiny random model (float32, 64 tokens per answer), where a forward pass is so short
that the engine is bound by Python, not arithmetic, so the server's own Python work (HTTP, JSON,
recording) competes with it for the GIL and the second core: the worst case for the ratio; and
SmolLM2-135M-Instruct (bfloat16, as the demo serves it; 32 tokens per answer, fewer requests),
the real model, when `.cache/smollm2-135m-instruct` exists or can be built
(KAIZEN_BENCH_EXPLORER_MODELS=tiny,smollm2 picks them).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.bench.common import TINY, run_load, table
from tests.helpers import free_port, kaizen_process, wait_http

SMOLLM2 = ".cache/smollm2-135m-instruct"


@dataclass(frozen=True)
class Setup:
    label: str
    model: str
    dtype: str
    max_tokens: int
    totals: dict[int, int]


SETUPS = {
    "tiny": Setup("tiny model, float32", TINY, "float32", 64, {1: 24, 8: 128, 32: 320}),
    "smollm2": Setup("SmolLM2-135M-Instruct, bfloat16", SMOLLM2, "bfloat16", 32, {1: 4, 8: 16, 32: 64}),
}


def _messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Request number {i}: tell me about the weather in paris."}]


class BareEngine:
    """The same HFEngine, called in-process: no HTTP, no recording."""

    def __init__(self, setup: Setup):
        self.setup = setup

    async def start(self):
        from services.explorer.serving.engines.hf import HFEngine

        self.engine = HFEngine(model_path=self.setup.model, dtype=self.setup.dtype, max_batch_size=32, torch_threads=1)
        await self.engine.start()
        self.prompts = {}

    async def one(self, i: int) -> int:
        from services.explorer.serving.engines.base import GenerateRequest, SamplingParams

        tok = self.engine.tokenizer
        text = tok.apply_chat_template(_messages(i), add_generation_prompt=True, tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
        req = GenerateRequest(request_id=str(i), prompt_token_ids=ids, params=SamplingParams(max_tokens=self.setup.max_tokens, seed=i))
        n = 0
        async for ups in self.engine.generate(req):
            n += sum(len(u.token_ids) for u in ups)
        return n


class HTTPExplorer:
    def __init__(self, url: str, max_tokens: int):
        self.url = url
        self.max_tokens = max_tokens

    async def start(self):
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(base_url=self.url, limits=limits, timeout=600)

    async def one(self, i: int) -> int:
        r = await self.client.post("/v1/chat/completions", json={
            "model": "default", "messages": _messages(i), "max_tokens": self.max_tokens, "seed": i})
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]


async def interleaved(targets: dict, concurrencies, rounds: int, totals: dict[int, int]) -> dict:
    """Every round runs every target at every concurrency, so machine drift hits all of them."""
    for t in targets.values():
        await t.start()
        await run_load(t.one, concurrency=8, total=16)  # warm-up
    results = {(name, c): [] for name in targets for c in concurrencies}
    for _ in range(rounds):
        for c in concurrencies:
            for name, t in targets.items():
                results[(name, c)].append(await run_load(t.one, concurrency=c, total=totals[c]))
    return results


def buffer_write_rate(n: int = 20_000, batch: int = 512) -> tuple[float, int]:
    from services.common.buffer import count_by_status, create_buffer_engine, insert_experiences
    from services.common.records import Experience

    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as d:
        db = create_buffer_engine(f"sqlite:///{d}/bench.db")
        records = [
            Experience(
                experience_id=f"chatcmpl-{i:024x}-0", completion_id=f"chatcmpl-{i:024x}", agent="default",
                model_version=0, task_id=f"task-{i // 4}", run_id=str(i % 4),
                prompt_token_ids=[rng.randrange(992) for _ in range(128)],
                response_token_ids=[rng.randrange(992) for _ in range(64)],
                response_logprobs=[-rng.random() * 5 for _ in range(64)],
                messages=_messages(i), response={"role": "assistant", "content": "x" * 200},
                sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": 64, "seed": i},
            )
            for i in range(n)
        ]
        t0 = time.perf_counter()
        for k in range(0, n, batch):
            insert_experiences(engine=db, records=records[k : k + batch])
        seconds = time.perf_counter() - t0
        stored = sum(count_by_status(engine=db).values())
        db.dispose()
    return n / seconds, stored


def compare(setup: Setup, rounds: int) -> str:
    concurrencies = (1, 8, 32)
    with tempfile.TemporaryDirectory() as d, contextlib.ExitStack() as stack:
        urls = {}
        for name, extra in (("explorer", []), ("no-recording", ["recorder.enabled=false"])):
            port = free_port()
            args = ["explorer", f"model.path={setup.model}", f"model.dtype={setup.dtype}", f"buffer.url=sqlite:///{d}/{name}.db",
                    f"checkpoints.root={d}/ck", f"server.port={port}", "engine.torch_threads=1", "engine.max_batch_size=32",
                    "server.log_level=warning", *extra]
            proc = stack.enter_context(kaizen_process(*args, log_path=Path(d) / f"{name}.log"))
            urls[name] = f"http://127.0.0.1:{port}"
            wait_http(f"{urls[name]}/health", proc=proc, timeout=300)
        targets = {"bare": BareEngine(setup), "explorer": HTTPExplorer(urls["explorer"], setup.max_tokens),
                   "no-recording": HTTPExplorer(urls["no-recording"], setup.max_tokens)}
        res = asyncio.run(interleaved(targets, concurrencies, rounds, setup.totals))
        recorded = httpx.get(f"{urls['explorer']}/metrics").text

    def med(name, c, f):
        return statistics.median(f(r) for r in res[(name, c)])

    rows = []
    for c in concurrencies:
        b_c, e_c = med("bare", c, lambda r: r.completions_per_s), med("explorer", c, lambda r: r.completions_per_s)
        b_t, e_t = med("bare", c, lambda r: r.tokens_per_s), med("explorer", c, lambda r: r.tokens_per_s)
        b_p, e_p, n_p = (med(n, c, lambda r: r.p(0.5)) * 1e3 for n in ("bare", "explorer", "no-recording"))
        # The same round's two servers ran back to back: their p50 difference, median over rounds.
        paired = [(e.p(0.5) - n.p(0.5)) * 1e3 for e, n in zip(res[("explorer", c)], res[("no-recording", c)])]
        fails = sum(r.failures for r in res[("explorer", c)])
        rows.append([c, f"{b_c:.1f}", f"{e_c:.1f}", f"{e_c / b_c:.2f}", f"{b_t:.0f}", f"{e_t:.0f}", f"{e_t / b_t:.2f}",
                     f"{b_p:.1f}", f"{n_p:.1f}", f"{e_p:.1f}", f"{e_p - n_p:+.1f}",
                     f"{statistics.median(paired):+.1f} ({min(paired):+.0f}..{max(paired):+.0f})", fails])
    out = table(
        f"Explorer (HTTP + recording) vs the bare HFEngine in-process; {setup.label}, max_tokens={setup.max_tokens}, "
        f"requests per run {setup.totals}, 1 torch thread, median of {rounds} interleaved rounds",
        ["conc", "bare c/s", "explorer c/s", "ratio", "bare tok/s", "explorer tok/s", "ratio",
         "p50 bare ms", "p50 http-only ms", "p50 explorer ms", "recording adds ms",
         "paired (range)", "failed"],
        rows,
    )
    def metric(name: str) -> float:
        return next((float(line.split()[-1]) for line in recorded.splitlines() if line.startswith(name + " ")), float("nan"))

    recorded_n = metric("kaizen_experiences_recorded_total")
    handoffs, flushes = metric("kaizen_record_handoff_seconds_count"), metric("kaizen_recorder_flush_seconds_count")
    out += (
        f"\nRecording on the request path (build the records, queue them): mean "
        f"{1e6 * metric('kaizen_record_handoff_seconds_sum') / handoffs:.0f} us per request over {handoffs:.0f} requests "
        f"(goal: under 5 ms). Background writes: {flushes:.0f} batches, mean "
        f"{1e3 * metric('kaizen_recorder_flush_seconds_sum') / flushes:.1f} ms each, "
        f"{recorded_n / flushes:.1f} experiences per batch."
    )
    out += f"\n(experiences the explorer recorded during the run: {recorded_n:.0f}; http-only = the same server with recorder.enabled=false; "
    out += "paired = median over rounds of the p50 difference between the two servers run back to back, with its range)"
    return out


def main() -> str:
    rounds = int(os.environ.get("KAIZEN_BENCH_ROUNDS", "3"))
    out = ""
    for name in [x.strip() for x in os.environ.get("KAIZEN_BENCH_EXPLORER_MODELS", "tiny,smollm2").split(",") if x.strip()]:
        setup = SETUPS[name]
        if name == "smollm2":
            from services.common.pretrained import build_pretrained

            build_pretrained("smollm2-135m-instruct", Path(SMOLLM2))  # a no-op when it is already built
        out += compare(setup, rounds)
    rate, stored = buffer_write_rate()
    out += table("Buffer sustained write rate (SQLite WAL, synchronous=FULL, batches of 512)",
                 ["experiences", "stored", "experiences/s"], [[20_000, stored, f"{rate:.0f}"]])
    return out


if __name__ == "__main__":
    print(main())
