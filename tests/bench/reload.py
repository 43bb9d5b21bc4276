"""Reload latency under load: from LATEST being replaced to the first response made by the new version.

    python -m tests.bench.reload

A real `kaizen explorer` serves the tiny model with an agent adapter while 8 clients keep sending
requests; 10 times, a new version is published (atomic dir + LATEST rename) and we time how long
until a response carries it (``system_fingerprint`` names the version that produced it).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from tests.bench.common import TINY, table
from tests.helpers import free_port, kaizen_process, wait_http

RELOADS = 10
CLIENTS = 8


def _adapter_writer(model_path: str):
    """A function that writes a fresh random LoRA adapter of the tiny model into a directory."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_path),
                           LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))

    def write(d: Path) -> None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.01)
        model.save_pretrained(d)

    return write


async def _measure(url: str, publish) -> tuple[list[float], int, int]:
    latencies: list[float] = []
    failures = 0
    served = 0
    seen_at: dict[int, float] = {}
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def load():
            nonlocal failures, served
            while not stop.is_set():
                try:
                    r = await client.post("/v1/chat/completions", json={
                        "model": "agent", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16})
                    r.raise_for_status()
                    version = int(r.json()["system_fingerprint"].rsplit("-v", 1)[1])
                    seen_at.setdefault(version, time.perf_counter())
                    served += 1
                except Exception:
                    failures += 1

        workers = [asyncio.create_task(load()) for _ in range(CLIENTS)]
        await asyncio.sleep(2.0)
        for v in range(2, RELOADS + 2):
            await asyncio.to_thread(publish, v)
            t0 = time.perf_counter()
            while v not in seen_at:
                await asyncio.sleep(0.005)
            latencies.append(seen_at[v] - t0)
            await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*workers)
    return latencies, failures, served


def main() -> str:
    from services.common.checkpoints import publish_version

    model = os.environ.get("KAIZEN_BENCH_MODEL", TINY)
    write = _adapter_writer(model)
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "ck"

        def publish(v: int) -> None:
            publish_version(root, "agent", v, write, {"step": v})

        publish(1)
        port = free_port()
        args = ["explorer", f"model.path={model}", f"buffer.url=sqlite:///{d}/b.db", f"checkpoints.root={root}",
                f"server.port={port}", "agents.names=[agent]", "server.log_level=warning"]
        with kaizen_process(*args, log_path=Path(d) / "explorer.log") as proc:
            url = f"http://127.0.0.1:{port}"
            wait_http(f"{url}/health", proc=proc)
            latencies, failures, served = asyncio.run(_measure(url, publish))
            poll = httpx.get(f"{url}/v1/models").json()
    ms = [x * 1e3 for x in latencies]
    return table(
        f"Hot reload latency under load ({CLIENTS} clients, {RELOADS} reloads, reload.poll_interval_s=0.25): "
        "LATEST replaced -> first response made by the new version",
        ["reloads", "p50 ms", "max ms", "min ms", "requests served", "failed"],
        [[len(ms), f"{statistics.median(ms):.0f}", f"{max(ms):.0f}", f"{min(ms):.0f}", served, failures]],
    ) + f"\n(agent versions served at the end: {[m.get('version') for m in poll['data'] if m['id'] == 'agent']})"


if __name__ == "__main__":
    print(main())
