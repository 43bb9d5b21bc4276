"""`make bench` section replicas (also alone: `python -m tests.bench.replicas`): 1, 2 and 4 real
`kaizen explorer` replicas on one PostgreSQL (a throwaway server of its own, fsync on), side by
side, to see what saturates first as replicas are added (docs/SCALE.md quotes it).

Two loads, each CLIENTS clients for SECONDS seconds, spread over the replicas in turn:
  - chat: a chat of 2 tokens on the tiny model, its feedback and its commit, back to back (what a
    user's traffic costs end to end: the model, the recording, the database);
  - feedback: feedback and commit alone, on chats recorded beforehand (the database's part alone).
Printed for each: operations a second, chat latency p50/p99, experiences the database took a second,
and the CPU seconds a second the replicas, PostgreSQL and the clients (this process) used (from
/proc: on 2 cores, 2.0 is all there is), so the resource that runs out first can be named.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from sqlalchemy import func, select

from tests.bench.common import table

REPLICAS = (1, 2, 4)
CLIENTS = int(os.environ.get("KAIZEN_BENCH_REPLICA_CLIENTS", "32"))
SECONDS = float(os.environ.get("KAIZEN_BENCH_REPLICA_SECONDS", "20"))
# Rounds of 1, 2 and 4 replicas in turn (so a slow spell of the machine touches each alike): the
# figures are the rounds' medians with their range; the ratios are paired within a round.
ROUNDS = int(os.environ.get("KAIZEN_BENCH_REPLICA_ROUNDS", "3"))
TICK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pids: list[int]) -> float:
    """utime + stime of these processes and their children that were waited for (what /proc knows)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / TICK


def _postgres_pids() -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{entry}/comm").read_text().strip() == "postgres":
                    out.append(int(entry))
    return out


def _experiences(url: str) -> int:
    from services.common import buffer

    db = buffer.create_buffer_engine(url)
    try:
        with db.connect() as conn:
            return conn.execute(select(func.count()).select_from(buffer.experiences)).scalar()
    finally:
        db.dispose()


class Load:
    def __init__(self, urls: list[str], kind: str, ids: list[str]):
        self.urls, self.kind, self.ids = urls, kind, ids
        self.ops = 0
        self.failed = 0
        self.latencies: list[float] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def client(self, k: int) -> None:
        clients = [httpx.Client(base_url=u, timeout=60) for u in self.urls]
        i = k
        try:
            while not self.stop.is_set():
                http = clients[i % len(clients)]
                i += 1
                try:
                    if self.kind == "chat":
                        t0 = time.perf_counter()
                        r = http.post("/v1/chat/completions", json={
                            "model": "default", "messages": [{"role": "user", "content": f"client {k} turn {i}"}],
                            "max_tokens": 2, "metadata": {"task_id": f"c{k}-{i}"}})
                        r.raise_for_status()
                        latency = time.perf_counter() - t0
                        eid = r.json()["choices"][0]["experience_id"]
                    else:
                        eid, latency = self.ids[i % len(self.ids)], None
                    http.post("/feedback", json={"msg_ids": [eid], "reward": float(i % 2)}).raise_for_status()
                    http.post("/commit", json={"msg_ids": [eid]}).raise_for_status()
                    with self.lock:
                        self.ops += 1
                        if latency is not None:
                            self.latencies.append(latency)
                except httpx.HTTPError:
                    with self.lock:
                        self.failed += 1
        finally:
            for c in clients:
                c.close()


def _run(urls: list[str], kind: str, ids: list[str], explorer_pids: list[int], db_url: str) -> dict:
    load = Load(urls, kind, ids)
    threads = [threading.Thread(target=load.client, args=(k,), daemon=True) for k in range(CLIENTS)]
    rows0, pg0, ex0 = _experiences(db_url), _cpu_seconds(_postgres_pids()), _cpu_seconds(explorer_pids)
    me0 = time.process_time()
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(SECONDS)
    load.stop.set()
    for t in threads:
        t.join(60)
    seconds = time.perf_counter() - t0
    xs = sorted(load.latencies)
    return {
        "ops_s": load.ops / seconds, "failed": load.failed,
        "p50": statistics.median(xs) if xs else None, "p99": xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else None,
        "rows_s": (_experiences(db_url) - rows0) / seconds,
        "explorer_cpu": (_cpu_seconds(explorer_pids) - ex0) / seconds,
        "pg_cpu": (_cpu_seconds(_postgres_pids()) - pg0) / seconds,
        "clients_cpu": (time.process_time() - me0) / seconds,
    }


def main() -> str:
    from tests.helpers import REPO, PostgresUnavailable, free_port, fresh_database, kaizen_process, postgres_server, wait_http

    tiny = REPO / ".cache" / "tiny-model"
    if not (tiny / "config.json").exists():
        subprocess.run([sys.executable, "-m", "services.cli", "tiny-model", str(tiny)], cwd=REPO, check=True)
    results: dict[int, list[dict[str, dict]]] = {n: [] for n in REPLICAS}
    with tempfile.TemporaryDirectory(prefix="kaizen-replicas-") as tmp, contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(postgres_server())
        except PostgresUnavailable as e:
            return f"replicas: skipped ({e})"
        for round_, n in ((r, n) for r in range(ROUNDS) for n in REPLICAS):
            db_url = stack.enter_context(fresh_database(server))
            with contextlib.ExitStack() as replicas:
                ports = [free_port() for _ in range(n)]
                procs = [replicas.enter_context(kaizen_process(
                    "explorer", f"model.path={tiny}", f"buffer.url={db_url}", f"checkpoints.root={tmp}/ck-{round_}-{n}",
                    f"recorder.journal_dir={tmp}/journal-{round_}-{n}", "reload.enabled=false", "engine.torch_threads=1",
                    f"server.port={p}", "server.log_level=warning", log_path=Path(tmp) / f"explorer-{round_}-{n}-{i}.log"))
                    for i, p in enumerate(ports)]
                urls = [f"http://127.0.0.1:{p}" for p in ports]
                for url, proc in zip(urls, procs):
                    wait_http(f"{url}/health", proc=proc)
                pids = [p.pid for p in procs]
                chat = _run(urls, "chat", [], pids, db_url)
                from services.common import buffer

                db = buffer.create_buffer_engine(db_url)
                ids = [e.experience_id for e in buffer.list_experiences(engine=db, limit=5000)]
                db.dispose()
                results[n].append({"chat": chat, "feedback": _run(urls, "feedback", ids, pids, db_url)})
    cpu = open("/proc/cpuinfo").read().split("model name", 1)[1].split("\n", 1)[0].strip(" :\t")

    def spread(values: list[float], fmt: str) -> str:
        """The median, and the range over the rounds when there are several."""
        med = format(statistics.median(values), fmt)
        return med if len(values) < 2 else f"{med} ({format(min(values), fmt)}-{format(max(values), fmt)})"

    def ms(values: list[float | None]) -> str:
        got = [v * 1000 for v in values if v is not None]
        return spread(got, ".0f") if got else "-"

    rows = []
    for n, rounds in results.items():
        for kind in ("chat", "feedback"):
            ms_ = [r[kind] for r in rounds]
            rows.append([str(n), kind, spread([m["ops_s"] for m in ms_], ".1f"), ms([m["p50"] for m in ms_]),
                         ms([m["p99"] for m in ms_]), spread([m["rows_s"] for m in ms_], ".1f"),
                         spread([m["explorer_cpu"] for m in ms_], ".2f"), spread([m["pg_cpu"] for m in ms_], ".2f"),
                         spread([m["clients_cpu"] for m in ms_], ".2f"), str(sum(m["failed"] for m in ms_))])
    ratios = ", ".join(
        f"{n} replicas " + ", ".join(
            spread([results[n][r][kind]["ops_s"] / results[REPLICAS[0]][r][kind]["ops_s"] for r in range(ROUNDS)], ".2f")
            + f"x {kind}" for kind in ("chat", "feedback"))
        for n in REPLICAS[1:])
    return (table(f"replicas ({CLIENTS} clients, {SECONDS:.0f} s a load, one PostgreSQL, tiny model; median of {ROUNDS} "
                  f"rounds (range); {os.cpu_count()} CPUs: {cpu})",
                  ["replicas", "load", "ops/s", "chat p50 ms", "p99 ms", "rows/s", "replicas' CPU", "PG CPU", "clients' CPU",
                   "failed"], rows)
            + f"\n  against 1 replica, paired by round: {ratios}")


if __name__ == "__main__":
    from services.common.logging import setup_logging

    setup_logging("warning")
    print(main())
