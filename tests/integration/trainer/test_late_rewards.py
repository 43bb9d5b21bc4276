"""late_rewards: retrain through the real `kaizen trainer`, killed with -9 in both windows of the step
that retrains: rewards sent for experiences a published version was already trained on are recorded
(never refused), trained again once in the agent's next step, and never twice. A kill after the step's
state was saved but before its commit leaves them pending, and the restarted Trainer trains them in the
step it redoes; a kill after that commit but before the version is published leaves them retrained in
it, and the next Trainer publishes it (with their ids) without training them again. One that comes
more than max_staleness versions after the call was made is set down with why, not trained."""

from __future__ import annotations

import json

import pytest

from services.common import buffer, checkpoints
from tests.integration.trainer.runs import AGENT, Trainers, copy_db, killed_at_failpoint

pytestmark = pytest.mark.integration

GRPO = ("algorithm.name=grpo", "save_interval=1", "late_rewards.mode=retrain", "algorithm.grpo.group_wait_s=0")


def _run(trainers: Trainers, label: str, steps: int, *extra: str) -> None:
    proc = trainers.start(label, *GRPO, *extra, "--max-steps", str(steps))
    assert proc.wait(240) == 0, trainers.log(proc)[-4000:]


def _records(trainers: Trainers) -> list[dict]:
    return [json.loads(line) for line in (trainers.run / "run" / "metrics.jsonl").read_text().splitlines()]


def test_a_late_reward_is_retrained_once_across_a_kill(tiny_model, faults_db, ray_address, tmp_path):
    trainers = Trainers(tiny_model, tmp_path / "late", ray_address)
    try:
        url = copy_db(faults_db, trainers.run)
        _run(trainers, "first", 1)  # v1: one batch of whole groups
        db = buffer.create_buffer_engine(url)
        trained = [buffer.get_experience(engine=db, experience_id=e) for e, v in buffer.consumed_ids(engine=db, agent=AGENT)]
        assert trained and {v for _, v in buffer.consumed_ids(engine=db, agent=AGENT)} == {1}
        # the verdicts come in late and differ by run (every group gets signal): recorded, not refused
        for e in trained:
            result = buffer.apply_feedback(engine=db, msg_ids=[e.experience_id], reward=1.0 if e.run_id == "0" else 0.0,
                                           feedback={"source": "late-review"})
            assert result.late == [e.experience_id]
        assert len(buffer.pending_late_rewards(engine=db, agent=AGENT, limit=100)) == len(trained)

        # step 2 trains them again but is killed before its commit: they stay pending
        killed_at_failpoint(trainers, "killed", "trainer.after_state_saved", *GRPO)
        assert len(buffer.pending_late_rewards(engine=db, agent=AGENT, limit=100)) == len(trained)
        assert len(_records(trainers)) == 1

        # step 2 again, committed (each late reward retrained in v2), killed before v2 is published
        killed_at_failpoint(trainers, "committed", "trainer.after_consume_commit", *GRPO)
        assert buffer.pending_late_rewards(engine=db, agent=AGENT, limit=100) == []
        step2 = buffer.last_trainer_step(engine=db, agent=AGENT)
        assert (step2.step, step2.version, step2.metrics["late_retrained"]) == (2, 2, len(trained))
        assert checkpoints.read_latest(trainers.run / "ck", AGENT, fallback=False) == 1
        # one more verdict for a call made by v0, now 2 versions back: past max_staleness 1, it is set down, not
        # trained (the fresh rows, as stale, are downweighted, so step 3 still trains). The next Trainer first
        # publishes the v2 it owes.
        stale = trained[0].experience_id
        buffer.apply_feedback(engine=db, msg_ids=[stale], reward=0.5, feedback={"source": "late-review"})
        _run(trainers, "after", 1, "staleness.max_staleness=1", "staleness.policy=downweight")  # step 3
        records = _records(trainers)  # step 2's line, which the kill kept from being written, from the buffer's record
        assert [(r["step"], r.get("recovered", False)) for r in records] == [(1, False), (2, True), (3, False)]
        assert [r["late_retrained"] for r in records] == [0, len(trained), 0]
        assert checkpoints.read_latest(trainers.run / "ck", AGENT, fallback=False) == 3
        assert buffer.pending_late_rewards(engine=db, agent=AGENT, limit=100) == []
        assert buffer.retrained_in(engine=db, agent=AGENT, version=2) == sorted(e.experience_id for e in trained)
        for e in trained:
            history = buffer.reward_history(engine=db, experience_id=e.experience_id)
            # (the buffer was filled with its first rewards directly, so the ledger begins with the late one)
            want = [("retrained in v2", True, 1)]
            if e.experience_id == stale:
                want.append(("not retrained: 2 versions stale (staleness.max_staleness 1)", True, 1))
            assert [(h["outcome"], h["late"], h["trained_in"]) for h in history] == want
            again = buffer.get_experience(engine=db, experience_id=e.experience_id)
            assert (again.status.value, again.trained_in) == ("consumed", 1)  # its lineage stays v1's
        db.dispose()
        manifest = checkpoints.validate_version(trainers.run / "ck", AGENT, 2).manifest()
        assert manifest["late_retrained_ids"] == sorted(e.experience_id for e in trained)
        assert "late_retrained_ids" not in checkpoints.validate_version(trainers.run / "ck", AGENT, 3).manifest()
    finally:
        trainers.close()
