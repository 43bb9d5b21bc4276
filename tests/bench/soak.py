"""Soak: 64 concurrent clients against a real `kaizen explorer` for a bounded time, each chatting,
rewarding its answer and committing it, over and over.

    python -m tests.bench.soak          # KAIZEN_SOAK_S=300 for a longer run (default 90 s)

Reports errors (goal 0), chat latency p50 / p99 and the Explorer's resident memory after warm-up
and at the end (goal: bounded, no growth after warm-up), sampled every few seconds.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

import httpx

from tests.bench.common import TINY, table
from tests.helpers import free_port, kaizen_process, wait_http

CLIENTS = 64
SOAK_S = float(os.environ.get("KAIZEN_SOAK_S", "90"))
WARMUP_S = 15.0
SAMPLE_S = 5.0


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _soak(base: str, pid: int) -> dict:
    latencies: list[float] = []
    errors: dict[str, int] = {}
    done = {"chats": 0, "feedbacks": 0, "commits": 0}
    memory: list[tuple[float, float]] = []
    t0 = time.monotonic()
    end = t0 + SOAK_S
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as http:

        async def client(k: int) -> None:
            i = 0
            while time.monotonic() < end:
                i += 1
                step = "chat"
                try:
                    s = time.perf_counter()
                    r = await http.post("/v1/chat/completions", json={
                        "model": "default", "messages": [{"role": "user", "content": f"client {k} asks {i}"}],
                        "max_tokens": 8, "metadata": {"task_id": f"soak-{k}-{i}"}})
                    r.raise_for_status()
                    latencies.append(time.perf_counter() - s)
                    done["chats"] += 1
                    eid = r.json()["choices"][0]["experience_id"]
                    step = "feedback"
                    (await http.post("/feedback", json={"msg_ids": [eid], "reward": float(i % 2)})).raise_for_status()
                    done["feedbacks"] += 1
                    step = "commit"
                    (await http.post("/commit", json={"msg_ids": [eid]})).raise_for_status()
                    done["commits"] += 1
                except Exception as e:
                    key = f"{step}: {type(e).__name__}"
                    errors[key] = errors.get(key, 0) + 1

        async def sample() -> None:
            while time.monotonic() < end:
                memory.append((time.monotonic() - t0, _rss_mib(pid)))
                await asyncio.sleep(SAMPLE_S)
            memory.append((time.monotonic() - t0, _rss_mib(pid)))

        await asyncio.gather(sample(), *(client(k) for k in range(CLIENTS)))
    return {"latencies": sorted(latencies), "errors": errors, "done": done, "memory": memory,
            "seconds": time.monotonic() - t0}


def main() -> str:
    with tempfile.TemporaryDirectory(prefix="kaizen-soak-") as d:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        args = ["explorer", f"model.path={TINY}", f"buffer.url=sqlite:///{d}/buffer.db", f"checkpoints.root={d}/ck",
                f"server.port={port}", f"recorder.journal_dir={d}/journal", "server.log_level=warning"]
        with kaizen_process(*args, log_path=Path(d) / "explorer.log") as proc:
            wait_http(f"{base}/health", proc=proc)
            r = asyncio.run(_soak(base, proc.pid))
    lat, mem = r["latencies"], r["memory"]
    p = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3 if lat else float("nan")  # noqa: E731
    after_warmup = [m for t, m in mem if t >= WARMUP_S] or [m for _, m in mem]
    errors = sum(r["errors"].values())
    rows = [[f"{r['seconds']:.0f}", CLIENTS, r["done"]["chats"], r["done"]["feedbacks"], r["done"]["commits"], errors,
             f"{p(0.5):.0f}", f"{p(0.99):.0f}", f"{mem[0][1]:.0f}", f"{after_warmup[0]:.0f}", f"{max(after_warmup):.0f}",
             f"{mem[-1][1]:.0f}", f"{mem[-1][1] / after_warmup[0]:.3f}"]]
    out = table(f"soak: {CLIENTS} clients chat, reward and commit for {SOAK_S:.0f} s on the tiny model (goal: 0 errors, "
                "memory flat after warm-up)",
                ["s", "clients", "chats", "feedbacks", "commits", "errors", "p50 ms", "p99 ms", "RSS start MiB",
                 f"RSS at {WARMUP_S:.0f}s", "RSS max", "RSS end", "end / warm"], rows)
    if r["errors"]:
        out += "\nerrors: " + ", ".join(f"{k} x{n}" for k, n in sorted(r["errors"].items()))
    out += "\nRSS MiB every ~5 s: " + " ".join(f"{m:.0f}" for _, m in mem)
    return out


if __name__ == "__main__":
    print(main())
