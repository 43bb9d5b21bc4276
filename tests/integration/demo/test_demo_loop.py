"""`kaizen demo task=parity`, scaled down: a real Explorer, a real Trainer and simulated traffic, end to end.

The demo runs as a user runs it (a subprocess of ``python -m services.cli demo``) on the tiny model,
with its run folder under tmp_path and its Trainer joining the session's Ray cluster. Everything
is then checked from what the run left behind: summary.json, the run's SQLite buffer, explorer.log
and the checkpoint folder.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from sqlalchemy import select

from services.common import buffer, checkpoints
from services.common.release import EVAL_TASK_PREFIX
from tests.helpers import REPO

pytestmark = pytest.mark.integration

AGENT = "parity"
START_VERSION = 1  # the warm start publishes v1 before the Explorer and the Trainer start
LOOP_SECONDS = 30  # the loop goes on after this until traffic was served by MIN_NEW_VERSIONS new versions ...
MIN_NEW_VERSIONS = 3
MAX_LOOP_SECONDS = 240  # ... but no longer than this (a slow or noisy machine, or a Trainer that never trains)


def _tail(path: Path, n: int = 60) -> str:
    if not path.exists():
        return f"({path.name}: missing)"
    lines = path.read_text(errors="replace").splitlines()
    return f"--- {path.name} (last {n} lines)\n" + "\n".join(lines[-n:])


@pytest.fixture(scope="module")
def demo_run(tiny_model, ray_address, tmp_path_factory) -> Path:
    """One scaled-down demo; its run folder. Shared by the tests of this module."""
    base = tmp_path_factory.mktemp("demo")
    args = [
        sys.executable, "-m", "services.cli", "demo", "--config", "configs/demo.yaml", "task=parity",
        f"run_dir={base / 'runs'}", f"model_path={tiny_model}", f"agent={AGENT}",
        f"duration_s={LOOP_SECONDS}", f"min_new_versions={MIN_NEW_VERSIONS}", f"max_duration_s={MAX_LOOP_SECONDS}",
        "progress_every_s=5",
        "parity.heldout_numbers=8", "parity.eval_samples=2",
        "parity.warm_start.steps=5",
        "parity.traffic.tasks_per_batch=8", "parity.traffic.repeat=4", "parity.traffic.concurrency=16",
        f"trainer.ray.address={ray_address}",
        "explorer.server.log_level=info",  # so explorer.log names every version it hot-loads
    ]
    out = base / "demo.out"
    with open(out, "wb") as f:
        proc = subprocess.run(args, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=600,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    runs = sorted(p for p in (base / "runs").glob("*") if p.is_dir()) if (base / "runs").exists() else []
    logs = "\n".join(_tail(p) for p in [out, *(r / n for r in runs for n in ("explorer.log", "trainer.log"))])
    assert proc.returncode == 0, f"kaizen demo exited with {proc.returncode}\n{logs}"
    assert len(runs) == 1, f"expected one run folder under {base / 'runs'}, found {runs}\n{logs}"
    assert (runs[0] / "summary.json").exists(), logs
    return runs[0]


@pytest.fixture(scope="module")
def summary(demo_run) -> dict:
    return json.loads((demo_run / "summary.json").read_text())


@pytest.fixture(scope="module")
def traffic(demo_run) -> list[dict]:
    """The experiences of the simulated traffic (they carry a task_id; evaluation requests do not),
    in the order the Explorer leased their versions (created_at), insertion order breaking ties."""
    engine = buffer.create_buffer_engine(f"sqlite:///{demo_run / 'buffer.db'}", create_tables=False)
    e = buffer.experiences.c
    q = (select(e.seq, e.experience_id, e.agent, e.model_version, e.task_id, e.reward, e.status, e.trained_in, e.created_at)
         .where(e.task_id.is_not(None), ~e.task_id.startswith(EVAL_TASK_PREFIX)).order_by(e.created_at, e.seq))
    try:
        with engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(q)]
    finally:
        engine.dispose()


def test_release_check_shows_the_gate_rejecting_a_broken_candidate_and_promoting_a_copy(demo_run, summary):
    checks = summary["release_check"]
    assert [(d["candidate"], d["decision"], d["by"]) for d in checks] == [
        ("a deliberately broken copy", "rejected", "gate"), ("an exact copy", "promoted", "gate")]
    broken, copy = checks
    assert broken["figures"]["mean_candidate"] < broken["figures"]["mean_serving"]
    assert copy["figures"]["diff"] == 0  # greedy answers of the same weights
    out = (demo_run.parent.parent / "demo.out").read_text()
    assert f"gate: v{broken['version']} (a deliberately broken copy" in out and f"gate: v{copy['version']} (an exact copy" in out
    # the broken one never served: no experience outside the gate's own evaluation was produced by it
    engine = buffer.create_buffer_engine(f"sqlite:///{demo_run / 'buffer.db'}", create_tables=False)
    try:
        by_broken = [x for x in buffer.list_experiences(engine=engine, agent=AGENT, limit=100_000)
                     if x.model_version == broken["version"] and not (x.task_id or "").startswith(EVAL_TASK_PREFIX)]
    finally:
        engine.dispose()
    assert by_broken == []


def test_no_request_failed(summary, traffic):
    assert summary["failed_requests"] == 0, summary["failed_requests"]
    served = summary["explorer_requests"]
    chats = served.get("/v1/chat/completions", {})
    # every traffic experience is one choice of one chat completion (n=1), all answered by this Explorer
    assert sum(chats.values()) >= len(traffic) > 0, (served, len(traffic))
    assert sum(served.get("/feedback", {}).values()) >= len(traffic), served
    assert sum(served.get("/commit", {}).values()) >= 1, served
    errors = {route: {s: n for s, n in by_status.items() if not s.startswith("2")} for route, by_status in served.items()}
    assert not any(errors.values()), f"the Explorer answered with errors: {errors}"
    # every episode got its reward and was committed: nothing is left recorded or merely rewarded
    stuck = [(t["experience_id"], t["status"]) for t in traffic if t["reward"] is None or t["status"] in ("recorded", "rewarded")]
    assert not stuck, f"{len(stuck)} traffic experiences never reached the Trainer, e.g. {stuck[:5]}"
    episodes = sum(r["episodes"] for r in summary["rounds"])
    assert episodes == len(traffic), (episodes, len(traffic))


def test_at_least_two_versions_were_published_and_hot_loaded_during_traffic(demo_run, summary, traffic):
    root = demo_run / "checkpoints"
    published = checkpoints.list_versions(root, AGENT)
    served = sorted({t["model_version"] for t in traffic if t["agent"] == AGENT})
    new = [v for v in served if v > START_VERSION]
    assert len(new) >= 2, f"traffic was served by versions {served}; published {published}; trainer steps {summary['trainer_steps']}"
    # the loop started on the warm start and moved on while the traffic kept flowing
    assert traffic[0]["model_version"] == START_VERSION, traffic[0]
    # ... and kept going after the second new version was loaded: a later one served traffic too
    assert any(t["model_version"] > new[1] for t in traffic), f"traffic ended with v{new[1]}: served {served}"
    # each version that served traffic is a complete published checkpoint, and the Explorer says it loaded it
    for v in served:
        assert v in published, (v, published)
        checkpoints.validate_version(root, AGENT, v)
    assert summary["reloads"] >= len(served), (summary["reloads"], served)
    log = (demo_run / "explorer.log").read_text(errors="replace")
    loaded = {int(m) for m in re.findall(rf"agent {AGENT}: now serving v(\d+)", log)}
    assert set(new) <= loaded, f"versions served {new}, reloads logged {sorted(loaded)}"
    assert "refusing version" not in log


def test_experiences_carry_versions_in_increasing_order(traffic):
    by_agent: dict[str, list[dict]] = defaultdict(list)
    for t in traffic:
        by_agent[t["agent"]].append(t)
    assert set(by_agent) == {AGENT}
    for agent, rows in by_agent.items():
        backwards = [(a["experience_id"], a["model_version"], a["created_at"], b["experience_id"], b["model_version"], b["created_at"])
                     for a, b in zip(rows, rows[1:]) if b["model_version"] < a["model_version"]]
        assert not backwards, f"{agent}: {len(backwards)} experiences leased an older version than the one before, e.g. {backwards[:3]}"
    # lineage: an experience is trained on by a step that publishes a newer version than the one that produced it
    consumed = [t for t in traffic if t["status"] == "consumed"]
    assert consumed
    bad = [(t["experience_id"], t["model_version"], t["trained_in"]) for t in consumed
           if t["trained_in"] is None or t["trained_in"] <= t["model_version"]]
    assert not bad, f"{len(bad)} experiences trained into a version not newer than their own, e.g. {bad[:3]}"
