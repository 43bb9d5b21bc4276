"""`kaizen demo task=parity`, scaled down: a real Explorer, a real Trainer and simulated traffic, end to end.

The demo runs as a user runs it (a subprocess of ``python -m services.cli demo``) on the tiny model,
with its run folder under tmp_path and its Trainer joining the session's Ray cluster. Everything
is then checked from what the run left behind: summary.json, the run's SQLite buffer, explorer.log
and the checkpoint folder.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict

import pytest
from sqlalchemy import select

from services.common import buffer, checkpoints
from services.common.release import EVAL_TASK_PREFIX
from tests.integration.demo.conftest import AGENT, START_VERSION

pytestmark = pytest.mark.integration


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
