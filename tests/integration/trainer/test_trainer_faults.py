"""kill -9 of the real `kaizen trainer` in each crash window and at random moments: every restart
repairs what the kill left and goes on, with no hand repair, nothing trained twice or skipped,
and LATEST naming the newest complete version.

The windows are hit exactly with failpoints (services/common/faults.py); each run joins the
session's Ray cluster, so a restart costs seconds. One run dir goes through: a kill after a step's
state is saved but before its commit, after a commit that completes a version before the version
is written, after ``v<N>`` is renamed into place but before LATEST, at random moments, and after
the very last commit; then a run that must publish the owed version with no data left. The
adapters must equal those of an uninterrupted run: a batch trained twice or skipped would show in
the weights even where the buffer's books balance.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from services.common import buffer, checkpoints
from tests.integration.trainer.data import FAULT_PROMPTS, FAULT_RESPONSES, FAULT_UNREWARDED
from tests.integration.trainer.runs import AGENT, BATCH, INTERVAL, Trainers, adapter_of, copy_db, killed_at_failpoint, steps_of

pytestmark = pytest.mark.integration

PROMPT_COUNT, RESPONSES, UNREWARDED = FAULT_PROMPTS, FAULT_RESPONSES, FAULT_UNREWARDED  # conftest.py faults_db
TOTAL = (PROMPT_COUNT * RESPONSES - UNREWARDED) // BATCH  # 14 steps, 7 versions
RANDOM_KILLS, SEED = 4, 1234
WAIT_S = 240.0


@pytest.fixture(scope="module")
def straight(tiny_model, faults_db, ray_address, tmp_path_factory) -> Path:
    """The run nobody killed, on the same buffer (one for every database the kill tests use: the
    adapters depend on the rows, not on where they are kept)."""
    run = tmp_path_factory.mktemp("straight")
    copy_db(faults_db, run)
    plain = Trainers(tiny_model, run, ray_address)
    try:
        proc = plain.start("straight", "--max-steps", str(TOTAL))
        assert proc.wait(WAIT_S) == 0, plain.log(proc)[-4000:]
    finally:
        plain.close()
    return run


@pytest.fixture(params=["sqlite", "postgres"])
def trainers(tiny_model, ray_address, tmp_path, request) -> Iterator[Trainers]:
    """The run's Trainers, on SQLite or on a fresh PostgreSQL database (the faults buffer copied in)."""
    url = None if request.param == "sqlite" else request.getfixturevalue("postgres_db_url")
    t = Trainers(tiny_model, tmp_path / "faulted", ray_address, url)
    try:
        yield t
    finally:
        t.close()


def _wait(cond, proc: subprocess.Popen, trainers: Trainers, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert proc.poll() is None, f"trainer exited with {proc.returncode} before {what}:\n{trainers.log(proc)[-4000:]}"
        assert time.monotonic() < deadline, f"no {what} within {WAIT_S}s:\n{trainers.log(proc)[-4000:]}"
        time.sleep(0.05)


def _temporaries(root: Path) -> list[str]:
    dirs = (checkpoints.agent_dir(root, AGENT), checkpoints.state_dir(root, AGENT))
    return [p.name for d in dirs for p in d.iterdir() if p.name.startswith(".") and p.name not in (".serving", checkpoints.PUBLISH_LOCK)]


def test_killed_anywhere_the_trainer_restarts_and_repairs(tiny_model, faults_db, ray_address, trainers, straight):
    run = trainers.run
    url = copy_db(faults_db, run, trainers.url)
    root = run / "ck"

    # Window 1: state/step-2 saved, its batch never committed.
    killed_at_failpoint(trainers, "after-state-saved", "trainer.after_state_saved@2")
    assert [s for s, _, _ in steps_of(url)] == [1]
    assert checkpoints.list_states(root, AGENT)[-1] == 2

    # Step 2 committed (it completes v1), v1 never written.
    killed_at_failpoint(trainers, "after-consume-commit", "trainer.after_consume_commit@1")
    assert [s for s, _, _ in steps_of(url)] == [1, 2] and checkpoints.list_versions(root, AGENT) == []

    # Window 2: v2 renamed into place, LATEST still names v1. The first arrival at this failpoint
    # is the restart finishing v1, which the database owes.
    killed_at_failpoint(trainers, "after-version-renamed", "trainer.after_version_renamed@2")
    assert [s for s, _, _ in steps_of(url)] == [1, 2, 3, 4]
    assert checkpoints.list_versions(root, AGENT) == [1, 2]
    assert checkpoints.read_latest(root, AGENT, fallback=False) == 1

    # kill -9 at random moments once the restart has repaired and resumed (mid-step, mid-save,
    # mid-commit, mid-publication ...). Each such run trains 2 steps at most, so the phase below
    # always has a step left; a kill that comes after those 2 steps finds a clean exit.
    rng = random.Random(SEED)
    for k in range(RANDOM_KILLS):
        proc = trainers.start(f"random-{k}", "--max-steps", "2")
        _wait(lambda: "resumed at step" in trainers.log(proc), proc, trainers, "a resumed agent")
        time.sleep(rng.uniform(0.0, 0.3))
        trainers.kill(proc)

    # The last step committed, its version (the last one) never written, and no data left to
    # train: a restart must publish it without waiting for new experiences.
    done = len(steps_of(url))
    assert done < TOTAL
    killed_at_failpoint(trainers, "last-commit", f"trainer.after_consume_commit@{TOTAL - done}")
    assert len(steps_of(url)) == TOTAL and checkpoints.list_versions(root, AGENT)[-1] < TOTAL // INTERVAL

    final = trainers.start("final")
    _wait(lambda: "waiting for committed experiences" in trainers.log(final), final, trainers, "an idle trainer")
    assert checkpoints.read_latest(root, AGENT, fallback=False) == TOTAL // INTERVAL, trainers.log(final)[-4000:]
    final.send_signal(signal.SIGTERM)  # a graceful stop, after the step in progress
    assert final.wait(60) == 0, trainers.log(final)[-4000:]

    # Every restart went on by itself: only the armed and the random kills ended a run early.
    for proc in trainers.procs[:-1]:
        assert proc.returncode in (0, -signal.SIGKILL), trainers.log(proc)[-4000:]

    # Books: every step once; every committed experience consumed exactly once or discarded.
    steps = steps_of(url)
    assert [s for s, _, _ in steps] == list(range(1, TOTAL + 1))
    db = buffer.create_buffer_engine(url)
    consumed = buffer.consumed_ids(engine=db, agent=AGENT)
    counts = buffer.count_by_status(engine=db, agent=AGENT)
    db.dispose()
    ids = [e for e, _ in consumed]
    assert len(ids) == len(set(ids)) == sum(n for _, _, n in steps) == TOTAL * BATCH
    assert counts.get("discarded") == UNREWARDED and not counts.get("committed")
    assert len(ids) == PROMPT_COUNT * RESPONSES - counts["discarded"]
    assert [sum(1 for _, v in consumed if v == ver) for ver in range(1, TOTAL // INTERVAL + 1)] == [INTERVAL * BATCH] * (TOTAL // INTERVAL)
    # Metrics: one line a step, the steps a kill after their commit left without one written by the restart
    # from what the buffer committed (at least the armed kills after commits: steps 2 and TOTAL).
    lines = [json.loads(line) for line in (run / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in lines) == list(range(1, TOTAL + 1)), [r["step"] for r in lines]
    recovered = {r["step"]: r for r in lines if r.get("recovered")}
    assert {2, TOTAL} <= set(recovered), sorted(recovered)
    assert all(r.get("published", False) == (s % INTERVAL == 0) and r["version"] == (s + INTERVAL - 1) // INTERVAL and "loss" in r
               for s, r in recovered.items())

    # Versions: every one complete, each manifest lists exactly what its steps consumed (so no
    # experience sits in two versions), LATEST names the newest, no temporaries left.
    versions = checkpoints.list_versions(root, AGENT)
    assert versions == list(range(1, TOTAL // INTERVAL + 1))
    assert checkpoints.read_latest(root, AGENT, fallback=False) == versions[-1]
    for ver in versions:
        manifest = checkpoints.validate_version(root, AGENT, ver).manifest()
        assert manifest["step"] == ver * INTERVAL
        assert manifest["experience_ids"] == sorted(e for e, v in consumed if v == ver)
    assert _temporaries(root) == []
    assert checkpoints.list_states(root, AGENT)[-1] == TOTAL

    # Weights: the same adapters as a run nobody killed, so no batch was trained twice or skipped.
    for ver in versions:
        a, b = adapter_of(straight / "ck", ver), adapter_of(root, ver)
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=1e-4, msg=lambda m: f"v{ver} {k}: {m}")


def test_killed_during_retention_the_trainer_repairs(tiny_model, faults_db, ray_address, trainers):
    """kill -9 while retention deletes an old version (renamed to .deleting-*, not yet removed):
    the restart removes the leftover, keeps the newest versions loadable, and trains on from where
    the database says, every experience once."""
    run = trainers.run
    url = copy_db(faults_db, run, trainers.url)
    root = run / "ck"
    keep = ("checkpoints.keep_versions=2", "checkpoints.delete_grace_s=0")
    proc = trainers.start("retention", *keep, failpoints="checkpoints.version_renamed_for_deletion")
    try:
        proc.wait(WAIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"retention never ran:\n{trainers.log(proc)[-4000:]}")
    assert proc.returncode == -signal.SIGKILL, trainers.log(proc)[-4000:]
    trainers.wait_learners_gone(proc)
    assert [p.name for p in (root / AGENT).iterdir() if p.name.startswith(".deleting-v1-")], "the kill left no leftover"

    final = trainers.start("after-retention", *keep)
    _wait(lambda: "waiting for committed experiences" in trainers.log(final), final, trainers, "an idle trainer")
    final.send_signal(signal.SIGTERM)
    assert final.wait(60) == 0, trainers.log(final)[-4000:]
    assert "removed" in trainers.log(final) and ".deleting-v1-" in trainers.log(final)
    newest = TOTAL // INTERVAL
    assert checkpoints.list_versions(root, AGENT) == [newest - 1, newest]
    assert checkpoints.read_latest(root, AGENT, fallback=False) == newest
    for v in (newest - 1, newest):
        checkpoints.validate_version(root, AGENT, v)
    assert _temporaries(root) == []
    steps = steps_of(url)
    assert [s for s, _, _ in steps] == list(range(1, TOTAL + 1))
    db = buffer.create_buffer_engine(url)
    ids = [e for e, _ in buffer.consumed_ids(engine=db, agent=AGENT)]
    db.dispose()
    assert len(ids) == len(set(ids)) == TOTAL * BATCH
