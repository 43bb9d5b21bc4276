"""What recording costs a chat request, with the journal on and off, and the rate at which the
recorder gets experiences into the buffer, side by side with bare batched inserts.

    python -m tests.bench.recording

The hot-path cost is ``Recorder.record`` for one request's records (build nothing, journal them,
queue them), timed per call in-process; the write rate is experiences from ``record`` to committed
rows (journal group-fsync included) against plain ``insert_experiences`` batches. Rounds interleave
the variants so machine drift hits each the same.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from services.common.buffer import create_buffer_engine, insert_experiences
from services.common.records import Experience
from services.explorer.recording.journal import DEAD_LETTERS, Journal
from services.explorer.recording.recorder import Recorder
from tests.bench.common import table

REQUESTS = 2_000


def _records(n: int, seed: int) -> list[Experience]:
    """A realistic request each: 128 prompt tokens, 64 sampled with logprobs, a short exchange."""
    rng = random.Random(seed)
    return [
        Experience(
            experience_id=f"chatcmpl-{seed:06x}{i:018x}-0", completion_id=f"chatcmpl-{seed:06x}{i:018x}", agent="default",
            model_version=0, task_id=f"task-{i // 4}", run_id=str(i % 4),
            prompt_token_ids=[rng.randrange(49_152) for _ in range(128)],
            response_token_ids=[rng.randrange(49_152) for _ in range(64)],
            response_logprobs=[-rng.random() * 5 for _ in range(64)],
            messages=[{"role": "user", "content": f"Request number {i}: tell me about the weather in paris."}],
            response={"role": "assistant", "content": "x" * 200},
            sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": 64, "seed": i},
        )
        for i in range(n)
    ]


async def _through_recorder(d: Path, journal: bool, records: list[Experience]) -> tuple[list[float], float]:
    db = create_buffer_engine(f"sqlite:///{d}/buffer.db")
    rec = Recorder(db=db, journal=Journal(d / "journal") if journal else None, dead_letters=d / DEAD_LETTERS)
    await rec.start()
    costs = []
    t0 = time.perf_counter()
    for r in records:
        c0 = time.perf_counter()
        rec.record([r])
        costs.append(time.perf_counter() - c0)
        await asyncio.sleep(0)  # requests arrive between other work: let the writer run
    await rec.flush(timeout=600)
    seconds = time.perf_counter() - t0
    await rec.stop()
    db.dispose()
    return costs, len(records) / seconds


def _bare_inserts(d: Path, records: list[Experience], batch: int = 512) -> float:
    db = create_buffer_engine(f"sqlite:///{d}/bare.db")
    t0 = time.perf_counter()
    for k in range(0, len(records), batch):
        insert_experiences(engine=db, records=records[k : k + batch])
    seconds = time.perf_counter() - t0
    db.dispose()
    return len(records) / seconds


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> str:
    rounds = int(os.environ.get("KAIZEN_BENCH_ROUNDS", "3"))
    p50 = {True: [], False: []}
    p99 = {True: [], False: []}
    rate = {True: [], False: [], "bare": []}
    for k in range(rounds):
        for journal in (True, False) if k % 2 == 0 else (False, True):
            with tempfile.TemporaryDirectory() as d:
                costs, r = asyncio.run(_through_recorder(Path(d), journal, _records(REQUESTS, seed=k * 2 + journal)))
            p50[journal].append(_pct(costs, 0.5) * 1e6)
            p99[journal].append(_pct(costs, 0.99) * 1e6)
            rate[journal].append(r)
        with tempfile.TemporaryDirectory() as d:
            rate["bare"].append(_bare_inserts(Path(d), _records(REQUESTS, seed=100 + k)))

    def spread(xs, fmt="{:.0f}"):
        return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}..{fmt.format(max(xs))})"

    rows = [
        ["journal on", spread(p50[True]), spread(p99[True]), spread(rate[True]),
         f"{statistics.median(rate[True]) / statistics.median(rate['bare']):.2f}"],
        ["journal off", spread(p50[False]), spread(p99[False]), spread(rate[False]),
         f"{statistics.median(rate[False]) / statistics.median(rate['bare']):.2f}"],
        ["bare inserts (512/batch)", "-", "-", spread(rate["bare"]), "1.00"],
    ]
    out = table(
        f"Recording: cost on the request path per chat (us) and experiences/s into the buffer (SQLite WAL, "
        f"synchronous=FULL); {REQUESTS} requests of 128+64 tokens, median (min..max) of {rounds} interleaved rounds",
        ["variant", "p50 us", "p99 us", "experiences/s", "rate vs bare"], rows,
    )
    out += (f"\nThe journal adds {statistics.median(p50[True]) - statistics.median(p50[False]):+.0f} us at p50 "
            f"(goal: p50 under 1,000 us with the journal on).")
    return out


if __name__ == "__main__":
    print(main())
