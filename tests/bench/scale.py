"""Scale: what the buffer's hot queries cost on a buffer of 10 thousand and of 1 million experiences,
side by side (goal: about the same; indexes, no full scans).

    python -m tests.bench.scale         # KAIZEN_SCALE_ROWS=100000 for a quicker, smaller big buffer

Each buffer (SQLite, the default) is filled with synthetic rows shaped like real ones: 4 agents,
mostly consumed (trained into versions of 1,000 per agent), some committed, rewarded and recorded,
about 20 rows per user, 30 days of timestamps. Measured per operation, median of the repetitions, through the same
buffer functions the services call: the Trainer's poll (oldest committed of an agent), a step's
commit (consume_batch), a publication's lineage (consumed_ids of one version), /feedback
(apply_feedback), /commit, /experiences (by agent and status, and by task), the back-pressure count,
a retention pass with nothing to purge, and deleting one user's data.

The same buffers then serve ``kaizen dashboard`` (its app on a loopback port, called with httpx as
the page's script calls it): the time of each API call a page makes, and of a whole page's data
(overview: /api/me, /api/agents, /api/overview), median of DASHBOARD_REPEAT, reading the rows
(``dashboard.rollups=false``) and, on the big buffer, again from its per-minute rollups once built;
and the rollups' own passes (the first build, a pass with nothing changed, one after a /feedback).
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import statistics
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from tests.bench.common import table

SIZES = (10_000, int(os.environ.get("KAIZEN_SCALE_ROWS", "1000000")))
AGENTS = ("a0", "a1", "a2", "a3")
REPEAT = 15
DASHBOARD_REPEAT = 5


def _fill(path: Path, rows: int) -> str:
    from services.common import buffer

    url = f"sqlite:///{path}"
    buffer.create_buffer_engine(url).dispose()  # tables and indexes
    rng = random.Random(0)
    start = datetime.now(timezone.utc) - timedelta(days=30)
    prompt = json.dumps(list(range(100, 164)))
    response = json.dumps(list(range(200, 216)))
    logprobs = json.dumps([-0.5] * 16)
    messages = json.dumps([{"role": "user", "content": "a question of some length " * 4}])
    answer = json.dumps({"role": "assistant", "content": "an answer"})
    sampling = json.dumps({"temperature": 1.0, "top_p": 1.0, "max_tokens": 16})
    conn = sqlite3.connect(path)
    batch = []

    def flush():
        conn.executemany(
            "INSERT INTO experiences (experience_id, completion_id, agent, model_version, task_id, run_id, "
            "prompt_token_ids, response_token_ids, response_logprobs, messages, response, sampling, reward, status, "
            "trained_in, created_at, updated_at, user_id) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", batch)
        batch.clear()

    for i in range(rows):
        share = i / rows
        status = "consumed" if share < 0.90 else "committed" if share < 0.95 else "rewarded" if share < 0.98 else "recorded"
        agent = AGENTS[i % len(AGENTS)]
        version = i // (1000 * len(AGENTS)) + 1
        # as SQLAlchemy writes a DateTime to SQLite (microseconds always): range bounds compare as strings
        created = (start + timedelta(seconds=30 * 86400 * share)).strftime("%Y-%m-%d %H:%M:%S.%f")
        batch.append((f"chatcmpl-{i:012d}-0", f"chatcmpl-{i:012d}", agent, version - 1 if status == "consumed" else version,
                      f"task-{i // 8}", str(i % 8), prompt, response, logprobs, messages, answer, sampling,
                      None if status == "recorded" else float(rng.random() < 0.5), status,
                      version if status == "consumed" else None, created, created, f"user-{rng.randrange(rows // 20)}"))  # about 20 rows a user
        if len(batch) >= 20_000:
            flush()
    flush()
    metrics = json.dumps({"loss": 0.01, "kl": 0.001, "entropy": 0.5, "clip_frac": 0.1, "logprob_mismatch": 0.01,
                          "staleness_mean": 1.0, "tokens_per_s": 500.0, "reward_mean": 0.5})
    conn.executemany(  # one Trainer step per version and agent, as the rows' trained_in say
        "INSERT INTO trainer_steps (agent, step, version, consumed, discarded, metrics, created_at) VALUES (?,?,?,?,?,?,?)",
        [(a, v, v, 1000, 0, metrics, start.isoformat(sep=" ")) for a in AGENTS
         for v in range(1, rows // (1000 * len(AGENTS)) + 2)])
    conn.commit()
    conn.execute("ANALYZE")
    conn.close()
    return url


def _time(fn, setup=None) -> float:
    """Median milliseconds of ``fn(arg)`` over REPEAT runs (``setup(k)`` gives each run its argument)."""
    out = []
    for k in range(REPEAT):
        arg = setup(k) if setup else None
        t0 = time.perf_counter()
        fn(arg)
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def _measure(url: str, rows: int) -> dict[str, float]:
    from services.common import buffer

    db = buffer.create_buffer_engine(url)
    e = buffer.experiences.c
    with db.connect() as conn:
        recorded = [r for r, in conn.execute(buffer.select(e.experience_id).where(e.status == "recorded").limit(REPEAT * 2))]
        rewarded = [r for r, in conn.execute(buffer.select(e.experience_id).where(e.status == "rewarded").limit(REPEAT))]
        tasks = [t for t, in conn.execute(buffer.select(e.task_id).where(e.status == "consumed").limit(1))]
    committed = {a: buffer.fetch_committed(engine=db, agent=a, limit=16 * REPEAT) for a in AGENTS}
    steps = iter(range(1, 10_000))
    users = iter(range(rows // 20))
    old = datetime.now(timezone.utc) - timedelta(days=365)
    out = {
        "Trainer poll (100 oldest committed)": _time(lambda _: buffer.fetch_committed(engine=db, agent="a1", limit=100)),
        "step commit (consume_batch, 16)": _time(
            lambda b: buffer.consume_batch(engine=db, agent="a0", step=next(steps), version=10_000, consumed=b,
                                           discarded=[], state_ref="s"),
            lambda k: {r.experience_id: r.reward for r in committed["a0"][16 * k:16 * (k + 1)]}),
        "publish lineage (one version)": _time(
            lambda _: buffer.consumed_ids(engine=db, agent="a0", trained_in=1)),  # 1,000 rows in both buffers
        "/feedback (apply_feedback, 1 id)": _time(
            lambda i: buffer.apply_feedback(engine=db, msg_ids=[i], reward=1.0, feedback={}), lambda k: recorded[k]),
        "/commit (1 id)": _time(lambda i: buffer.commit_experiences(engine=db, msg_ids=[i]), lambda k: rewarded[k]),
        "/experiences?agent&status (100)": _time(
            lambda _: buffer.list_experiences(engine=db, agent="a2", status="committed", limit=100)),
        "/experiences?task_id": _time(lambda _: buffer.list_experiences(engine=db, task_id=tasks[0], limit=100)),
        "back-pressure count (capped at 101)": _time(
            lambda _: buffer.committed_backlog(engine=db, agents=AGENTS, cap=101)),  # max_backlog 100
        "retention pass (nothing to purge)": _time(lambda _: buffer.purge_text(engine=db, before=old)),
        "DELETE user data (about 20 rows)": _time(lambda u: buffer.delete_user_data(engine=db, user_id=u),
                                                  lambda k: f"user-{next(users)}"),
    }
    db.dispose()
    return out


def _measure_rollups(url: str) -> dict[str, float]:
    """The dashboard's rollups in process: the first build (every agent's cells from the rows), a
    pass with nothing changed, and a pass after one /feedback (median ms)."""
    from services.common import buffer
    from services.dashboard.rollups import Rollups

    db = buffer.create_buffer_engine(url)
    rollups = Rollups(db, margin_s=120)  # the default: each pass reads again what was written in the last 2 minutes
    t0 = time.perf_counter()
    rollups.refresh()
    out = {"rollups: first build (every agent)": (time.perf_counter() - t0) * 1e3,
           "rollups: a pass, nothing changed": _time(lambda _: rollups.refresh())}
    with db.connect() as conn:
        e = buffer.experiences.c
        ids = [r for r, in conn.execute(buffer.select(e.experience_id).where(e.status == "recorded").offset(REPEAT * 2)
                                        .limit(REPEAT))]
    out["rollups: a pass after one /feedback"] = _time(
        lambda _: rollups.refresh(), lambda k: buffer.apply_feedback(engine=db, msg_ids=[ids[k]], reward=1.0, feedback={}))
    db.dispose()
    return out


def _measure_dashboard(url: str, root: Path, rollups: bool) -> dict[str, float]:
    import httpx

    from services.dashboard.app import create_app
    from services.dashboard.config import DashboardConfig
    from tests.helpers import ThreadedServer

    config = DashboardConfig.model_validate({"buffer": {"url": url}, "checkpoints": {"root": str(root)},
                                             "dashboard": {"rollups": rollups}})
    with ThreadedServer(create_app(config)) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        def get(path: str, **params) -> dict:
            r = client.get(path, params=params)
            r.raise_for_status()
            return r.json()

        deadline = time.monotonic() + 600
        while rollups and get("/api/overview", agent="a1")["rollups"]["state"] != "ready":
            assert time.monotonic() < deadline, "the rollups were not built in 10 minutes"
            time.sleep(0.2)
        one = get("/api/experiences", agent="a1", limit=1)["experiences"][0]["experience_id"]
        calls = {
            "overview page (me + agents + overview)": lambda: [get("/api/me"), get("/api/agents"),
                                                               get("/api/overview", agent="a1")],
            "/api/agents (4 agents, counts by status)": lambda: get("/api/agents"),
            "/api/overview (one agent)": lambda: get("/api/overview", agent="a1"),
            "/api/trainer (one agent)": lambda: get("/api/trainer", agent="a1"),
            "/api/versions (one agent)": lambda: get("/api/versions", agent="a1"),
            "/api/experiences (newest 50)": lambda: get("/api/experiences", agent="a1"),
            "/api/experiences (status, reward, page 3)": lambda: get(
                "/api/experiences", agent="a2", status="consumed", min_reward=1,
                before=get("/api/experiences", agent="a2", status="consumed", min_reward=1, limit=100)["next_before"]),
            "/api/experiences/{id}": lambda: get(f"/api/experiences/{one}"),
        }
        out = {}
        for name, call in calls.items():
            call()  # warm: the first call of a connection and the page cache
            times = []
            for _ in range(DASHBOARD_REPEAT):
                t0 = time.perf_counter()
                call()
                times.append((time.perf_counter() - t0) * 1e3)
            out[name] = statistics.median(times)
    return out


def main() -> str:
    results, dashboard = {}, {}
    with tempfile.TemporaryDirectory(prefix="kaizen-scale-") as d:
        for n in SIZES:
            t0 = time.perf_counter()
            url = _fill(Path(d) / f"b{n}.db", n)
            fill_s = time.perf_counter() - t0
            results[n] = _measure(url, n)
            results[n]["_fill_s"] = fill_s
            dashboard[n] = _measure_dashboard(url, Path(d) / f"checkpoints{n}", rollups=False)
            if n == SIZES[-1]:
                rolled = _measure_dashboard(url, Path(d) / f"checkpoints{n}", rollups=True)
                rollup_passes = _measure_rollups(url)
            Path(d, f"b{n}.db").unlink()
    small, big = SIZES
    rows = [[op, f"{results[small][op]:.2f}", f"{results[big][op]:.2f}", f"{results[big][op] / results[small][op]:.2f}"]
            for op in results[small] if not op.startswith("_")]
    rows += [[op, "", f"{ms:.2f}", ""] for op, ms in rollup_passes.items()]
    dash = [[op, f"{dashboard[small][op]:.1f}", f"{dashboard[big][op]:.1f}", f"{dashboard[big][op] / dashboard[small][op]:.2f}",
             f"{rolled[op]:.1f}", f"{dashboard[big][op] / rolled[op]:.1f}"]
            for op in dashboard[small]]
    return "\n".join([
        table(f"scale: buffer queries on {small:,} vs {big:,} experiences (SQLite, median ms of {REPEAT}; goal: ratio "
              f"about 1; filling took {results[small]['_fill_s']:.0f} s and {results[big]['_fill_s']:.0f} s)",
              ["operation", f"{small:,} ms", f"{big:,} ms", "ratio"], rows),
        table(f"scale: kaizen dashboard's API on the same buffers (4 agents; median ms of {DASHBOARD_REPEAT}, over HTTP on "
              "loopback; aggregates scan one agent's index range, or sum its per-minute rollups; lists are keyset pages)",
              ["call", f"{small:,} rows ms", f"{big:,} rows ms", "ratio", f"{big:,} rollups ms", "rows / rollups"], dash),
    ])


if __name__ == "__main__":
    print(main())
