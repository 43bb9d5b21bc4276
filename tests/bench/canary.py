"""Canary rollback: from a bad version's first canary request to its automatic rollback, at a stated
traffic rate, and how many user requests it served meanwhile.

    python -m tests.bench.canary

A real `kaizen explorer` (release.mode=canary, the default share, test and minimum sample) serves
the tiny model with a "good" adapter (answers the question right) while requests arrive at a fixed
rate, each its own task, each rewarded by whether its answer is right. A "bad" candidate (answers
wrong) is published ROUNDS times; each time we measure the seconds from its first served request to
the rollback decision, and the requests it served.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from tests.bench.common import TINY, table
from tests.helpers import free_port, kaizen_process, wait_http

RATE = 20.0  # requests per second, open loop
ROUNDS = 3
QUESTION, RIGHT, WRONG = "What is 2+2?", "4", "5"


async def _round(url: str, version: int, publish) -> tuple[float, int, int, int, dict]:
    """One bad candidate: (seconds from its first request to the rollback, its requests, all requests, failures, figures)."""
    first_bad: float | None = None
    bad = total = failures = 0
    tasks: set[asyncio.Task] = set()
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def one(k: int):
            nonlocal first_bad, bad, total, failures
            try:
                r = await client.post("/v1/chat/completions", json={
                    "model": "agent", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4,
                    "temperature": 0, "metadata": {"task_id": f"v{version}-user-{k}"}})
                r.raise_for_status()
                body = r.json()
                served_by = int(body["system_fingerprint"].rsplit("-v", 1)[1])
                total += 1
                if served_by == version:
                    bad += 1
                    first_bad = first_bad or time.perf_counter()
                reward = float(body["choices"][0]["message"]["content"].strip() == RIGHT)
                (await client.post("/feedback", json={"msg_ids": [body["id"]], "reward": reward})).raise_for_status()
            except Exception:
                failures += 1

        await asyncio.to_thread(publish, version)
        k, t0 = 0, time.perf_counter()
        decided_at, figures = None, {}
        while decided_at is None:
            while k < (time.perf_counter() - t0) * RATE:
                task = asyncio.create_task(one(k))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                k += 1
            if k % 10 == 0:
                rows = (await client.get("/versions", params={"agent": "agent"})).json()["data"]
                row = next((r for r in rows if r["version"] == version), {})
                final = [d for d in row.get("decisions", []) if d["decision"] in ("rolled_back", "promoted", "rejected")]
                if final:
                    decided_at, figures = time.perf_counter(), final[-1]
            await asyncio.sleep(0.01)
            if time.perf_counter() - t0 > 300:
                raise RuntimeError("no decision within 300 s")
        await asyncio.gather(*tasks)
    assert figures["decision"] == "rolled_back", figures
    return decided_at - (first_bad or decided_at), bad, total, failures, figures


def main() -> str:
    from services.common.checkpoints import publish_version, set_candidate, write_version
    from tests.integration.adapters import train_reply_adapter

    ask = [{"role": "user", "content": QUESTION}]
    good, wrong = train_reply_adapter(Path(TINY), ask, RIGHT), train_reply_adapter(Path(TINY), ask, WRONG)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "ck"
        publish_version(root, "agent", 1, lambda p: good.save_pretrained(p), {"step": 1})

        def publish(v: int) -> None:
            write_version(root, "agent", v, lambda p: wrong.save_pretrained(p), {"step": v, "parent_version": 1})
            set_candidate(root, "agent", v)

        port = free_port()
        args = ["explorer", f"model.path={TINY}", f"buffer.url=sqlite:///{d}/b.db", f"checkpoints.root={root}",
                f"server.port={port}", "agents.names=[agent]", "server.log_level=warning", "release.mode=canary",
                "reload.poll_interval_s=0.25", "release.poll_interval_s=0.25"]
        with kaizen_process(*args, log_path=Path(d) / "explorer.log") as proc:
            url = f"http://127.0.0.1:{port}"
            wait_http(f"{url}/health", proc=proc)
            for v in range(2, ROUNDS + 2):
                seconds, bad, total, failures, decision = asyncio.run(_round(url, v, publish))
                f = decision["figures"]
                rows.append([v, f"{seconds:.1f}", bad, total, f"{bad / max(total, 1):.2f}", failures,
                             f"{f['episodes']['candidate']}/{f['episodes']['serving']}", f"[{f['lower']:+.2f}, {f['upper']:+.2f}]"])
    secs = [float(r[1]) for r in rows]
    return table(
        f"Canary rollback of a bad version at {RATE:g} requests/s (release.canary defaults: share 0.1, min_episodes 20, "
        "tolerance 0.05, 95% confidence sequence): its first request -> rolled back",
        ["version", "seconds", "its requests", "all requests", "its share", "failed", "episodes cand/serving",
         "difference bounds"],
        rows,
    ) + f"\n(seconds: median {statistics.median(secs):.1f}, min {min(secs):.1f}, max {max(secs):.1f} over {len(secs)} rounds)"


if __name__ == "__main__":
    print(main())
