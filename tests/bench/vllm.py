"""The Explorer on the vllm engine vs vLLM's own OpenAI server, same model, same machine.

    python -m tests.bench.vllm          (or: python -m tests.bench.run vllm)

Two servers on the tiny model, started with the same engine settings (float32, eager, max_num_seqs
64, a 1 GiB KV cache, LoRA enabled with max_loras 4 / rank 16, processed logprobs, max_logprobs 20,
seed 0, stats logging off, access log off) and the same environment:

- ``kaizen explorer`` with ``engine.kind=vllm``, recording every exchange to SQLite;
- ``python -m vllm.entrypoints.openai.api_server``.

Both get the same non-streaming chat completions (max_tokens 64, temperature 1, seed = request
number) at concurrency 8 and 32. The Explorer ignores ``ignore_eos``, so neither gets it: with the
same prompt tokens and seed both sample the same tokens, and the table checks that the completion
token totals match. Throughput is completion tokens/s.

Only one server is loaded at a time (2 CPU cores would otherwise be shared between them); the idle
one stays up, and the CPU it uses while the other is measured is printed (vLLM's engine core sleeps
when it has no requests, so it is ~0). Rounds alternate which server goes first; figures are
medians over rounds. CPU seconds per 1000 tokens of each server's front-end process (HTTP,
rendering, detokenizing, and for the Explorer recording) and of its engine (engine core + worker)
show where any difference comes from.

Knobs: KAIZEN_BENCH_MODEL, KAIZEN_BENCH_VLLM_ROUNDS (default 8), KAIZEN_BENCH_VLLM_BUDGET_S (seconds
of measuring after which no new round starts, default 300; at least 2 rounds run).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.bench.common import TINY, LoadResult, clock_ticks_per_s, machine_busy_ticks, proc_stats, run_load, table
from tests.helpers import REPO, free_port, wait_http

MAX_TOKENS = 64
CONCURRENCIES = (8, 32)
TOTALS = {8: 64, 32: 192}
KV_GIB = 1
MAX_NUM_SEQS = 64
MAX_LORAS = 4
MAX_LORA_RANK = 16
START_TIMEOUT = 420.0
NAMES = ("explorer", "vllm")


def _messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Request number {i}: tell me about the weather in paris."}]


def _own_ticks() -> int:
    t = os.times()
    return round((t.user + t.system) * clock_ticks_per_s())


class Server:
    """One server as its own process group (so the engine core and worker die with it)."""

    def __init__(self, name: str, argv: list[str], port: int, model: str, log_path: Path, env: dict):
        self.name, self.argv, self.port, self.model, self.log_path, self.env = name, argv, port, model, log_path, env
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)

    def wait_ready(self) -> None:
        wait_http(f"{self.url}/health", timeout=START_TIMEOUT, proc=self.proc)

    def stop(self) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(1)  # let the engine core and worker exit after the leader
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._log.close()

    def cpu_ticks(self) -> dict[str, int]:
        """User+system clock ticks of this server's processes, by role: front (the HTTP process),
        engine (vLLM's engine core and worker processes), other."""
        out = {"front": 0, "engine": 0, "other": 0}
        if self.proc is None:
            return out
        pgid = self.proc.pid
        for pid, comm, rest in proc_stats():
            if int(rest[2]) != pgid:
                continue
            ticks = int(rest[11]) + int(rest[12])
            role = "front" if pid == pgid else "engine" if comm.startswith("VLLM::") else "other"
            out[role] += ticks
        return out


class Client:
    def __init__(self, server: Server):
        self.server = server
        self.errors: list[str] = []

    async def start(self):
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(base_url=self.server.url, limits=limits, timeout=600)

    async def close(self):
        await self.client.aclose()

    async def one(self, i: int) -> int:
        try:
            r = await self.client.post("/v1/chat/completions", json={
                "model": self.server.model, "messages": _messages(i), "max_tokens": MAX_TOKENS, "temperature": 1.0,
                "seed": i})
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
            return r.json()["usage"]["completion_tokens"]
        except Exception as e:
            self.errors.append(f"request {i}: {type(e).__name__}: {e}")
            raise


def _servers(model: str, d: str) -> dict[str, Server]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_CPU_KVCACHE_SPACE": str(KV_GIB)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    ex_port, vl_port = free_port(), free_port()
    explorer = [
        sys.executable, "-m", "services.cli", "explorer", "--config", "configs/explorer.yaml",
        f"model.path={model}", "model.dtype=float32", "engine.kind=vllm", "engine.vllm.enforce_eager=true",
        f"engine.vllm.kv_cache_gib={KV_GIB}", f"engine.max_batch_size={MAX_NUM_SEQS}",
        f"engine.vllm.max_loras={MAX_LORAS}", f"engine.vllm.max_lora_rank={MAX_LORA_RANK}", "engine.seed=0",
        f"buffer.url=sqlite:///{d}/buffer.db", f"checkpoints.root={d}/ck", "server.host=127.0.0.1",
        f"server.port={ex_port}", "server.log_level=warning",
    ]
    # The flags that make vLLM's server match VLLMEngine.engine_args() (services/explorer/serving/engines/vllm.py).
    vllm = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(vl_port), "--dtype", "float32", "--enforce-eager", "--seed", "0",
        "--max-num-seqs", str(MAX_NUM_SEQS), "--kv-cache-memory-bytes", str(KV_GIB * 2**30),
        "--enable-lora", "--max-loras", str(MAX_LORAS), "--max-lora-rank", str(MAX_LORA_RANK),
        "--logprobs-mode", "processed_logprobs", "--max-logprobs", "20", "--disable-log-stats",
        "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log",
    ]
    return {
        "explorer": Server("explorer", explorer, ex_port, "default", Path(d) / "explorer.log", env),
        "vllm": Server("vllm", vllm, vl_port, "tiny", Path(d) / "vllm.log", env),
    }


async def _measure(servers: dict[str, Server], rounds: int, budget_s: float) -> tuple:
    """Returns (load results, CPU ticks by role per run, idle server's ticks per run, rounds run,
    cores other processes on the machine kept busy meanwhile, failed requests' errors by server)."""
    clients = {name: Client(s) for name, s in servers.items()}
    for c in clients.values():
        await c.start()
        await run_load(c.one, concurrency=8, total=32)  # warm-up
    results = {(n, c): [] for n in NAMES for c in CONCURRENCIES}
    cpu = {(n, c): [] for n in NAMES for c in CONCURRENCIES}
    idle = {(n, c): [] for n in NAMES for c in CONCURRENCIES}
    t0 = time.monotonic()
    m0, o0, s0 = machine_busy_ticks(), _own_ticks(), sum(sum(s.cpu_ticks().values()) for s in servers.values())
    done = 0
    for r in range(rounds):
        if done >= 2 and time.monotonic() - t0 > budget_s:
            break
        for c in CONCURRENCIES:
            order = NAMES if r % 2 == 0 else NAMES[::-1]
            for name in order:
                other = servers[NAMES[1 - NAMES.index(name)]]
                a, ia = servers[name].cpu_ticks(), other.cpu_ticks()
                res = await run_load(clients[name].one, concurrency=c, total=TOTALS[c])
                b, ib = servers[name].cpu_ticks(), other.cpu_ticks()
                results[(name, c)].append(res)
                cpu[(name, c)].append({k: b[k] - a[k] for k in b})
                idle[(name, c)].append((sum(ib.values()) - sum(ia.values()), res.seconds))
        done += 1
    m1, o1, s1 = machine_busy_ticks(), _own_ticks(), sum(sum(s.cpu_ticks().values()) for s in servers.values())
    others = ((m1 - m0) - (o1 - o0) - (s1 - s0)) / clock_ticks_per_s() / (time.monotonic() - t0)
    for c in clients.values():
        await c.close()
    errors = {name: c.errors for name, c in clients.items() if c.errors}
    return results, cpu, idle, done, others, errors


def main() -> str:
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: no vllm here
        return f"\n== vllm: skipped (the vllm module is not importable: {e})"
    model = os.environ.get("KAIZEN_BENCH_MODEL", TINY)
    rounds = int(os.environ.get("KAIZEN_BENCH_VLLM_ROUNDS", "8"))
    budget_s = float(os.environ.get("KAIZEN_BENCH_VLLM_BUDGET_S", "300"))
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory() as d, contextlib.ExitStack() as stack:
        servers = _servers(model, d)
        for s in servers.values():  # start both at once: each start is mostly waiting
            stack.callback(s.stop)
            s.start()
        try:
            for s in servers.values():
                s.wait_ready()
        except Exception:
            logs = "\n".join(f"--- {s.name} log tail:\n" + s.log_path.read_text(errors="replace")[-3000:]
                             for s in servers.values())
            raise RuntimeError(f"a server did not start\n{logs}") from None
        t_ready = time.monotonic()
        idle_a = {n: sum(s.cpu_ticks().values()) for n, s in servers.items()}
        time.sleep(3)
        idle_rest = {n: (sum(s.cpu_ticks().values()) - idle_a[n]) / clock_ticks_per_s() / 3 for n, s in servers.items()}
        res, cpu, idle, done, others, errors = asyncio.run(_measure(servers, rounds, budget_s))
        metrics = httpx.get(f"{servers['explorer'].url}/metrics", timeout=30).text
        log_tails = {n: servers[n].log_path.read_text(errors="replace")[-2500:] for n in errors}
    wall = time.monotonic() - t_start

    def med(name, c, f):
        return statistics.median(f(r) for r in res[(name, c)])

    def cpu_per_ktok(name, c, role):
        return statistics.median(1000 * t[role] / clock_ticks_per_s() / r.tokens for t, r in zip(cpu[(name, c)], res[(name, c)]))

    rows, verdicts = [], []
    for c in CONCURRENCIES:
        e_t, v_t = med("explorer", c, LoadResult.tokens_per_s.fget), med("vllm", c, LoadResult.tokens_per_s.fget)
        e_c, v_c = med("explorer", c, LoadResult.completions_per_s.fget), med("vllm", c, LoadResult.completions_per_s.fget)
        e_p, v_p = (med(n, c, lambda r: r.p(0.5)) * 1e3 for n in NAMES)
        ratios = [e.tokens_per_s / v.tokens_per_s for e, v in zip(res[("explorer", c)], res[("vllm", c)])]
        same = all(e.tokens == v.tokens for e, v in zip(res[("explorer", c)], res[("vllm", c)]))
        fails = sum(r.failures for n in NAMES for r in res[(n, c)])
        rows.append([
            c, f"{v_t:.0f}", f"{e_t:.0f}", f"{e_t / v_t:.2f}", f"{statistics.median(ratios):.2f}",
            f"{min(ratios):.2f}-{max(ratios):.2f}",
            f"{v_c:.1f}", f"{e_c:.1f}", f"{v_p:.0f}", f"{e_p:.0f}",
            f"{cpu_per_ktok('vllm', c, 'front'):.2f}", f"{cpu_per_ktok('explorer', c, 'front'):.2f}",
            f"{cpu_per_ktok('vllm', c, 'engine'):.2f}", f"{cpu_per_ktok('explorer', c, 'engine'):.2f}",
            "yes" if same else "NO", fails,
        ])
        verdicts.append(f"concurrency {c}: {e_t / v_t:.2f} ({'meets' if e_t / v_t >= 0.95 else 'misses'} the goal)")
    out = table(
        f"Explorer (engine.kind=vllm, recording everything) vs vLLM's own OpenAI server; tiny model, float32, eager, "
        f"max_tokens={MAX_TOKENS}, temperature 1, per-request seed; median of {done} rounds, one server loaded at a time",
        ["conc", "vllm tok/s", "explorer tok/s", "ratio", "paired ratio", "paired range", "vllm c/s", "explorer c/s",
         "p50 vllm ms", "p50 explorer ms", "vllm front cpu-s/ktok", "explorer front cpu-s/ktok",
         "vllm engine cpu-s/ktok", "explorer engine cpu-s/ktok", "same tokens", "failed"],
        rows,
    )
    recorded_n = next((ln.split()[-1] for ln in metrics.splitlines() if ln.startswith("kaizen_experiences_recorded_total")), "?")
    steal = max(ticks / clock_ticks_per_s() / secs for v in idle.values() for ticks, secs in v)
    out += (
        f"\nGoal: explorer/vllm completion tokens/s (ratio of the medians) >= 0.95. "
        + "; ".join(verdicts)
        + f"\n(requests per run: {TOTALS}; experiences the explorer recorded: {recorded_n}; "
        f"idle CPU at rest: explorer {idle_rest['explorer']:.3f}, vllm {idle_rest['vllm']:.3f} cores; the idle server used "
        f"at most {steal:.3f} cores while the other was measured; cpu-s/ktok = CPU seconds per 1000 completion tokens, "
        f"front = the HTTP process, engine = vLLM engine core + worker; paired ratio = median over rounds of the ratio "
        f"of the two runs measured back to back; other processes on this {os.cpu_count()}-CPU machine kept "
        f"{others:.2f} cores busy during the measurements; start-up {t_ready - t_start:.0f}s, "
        f"section wall {wall:.0f}s)"
    )
    for name, errs in errors.items():
        out += f"\n{name}: {len(errs)} failed requests, e.g. " + " | ".join(errs[:3])
        out += f"\n--- {name} log tail:\n{log_tails[name]}"
    return out


if __name__ == "__main__":
    print(main())
