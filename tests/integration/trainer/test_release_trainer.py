"""The real `kaizen trainer` under a release policy: it publishes candidates, waits for their
decision, and continues from the version that serves (its own trainer state), never from a refused
one; what refused versions produced is discarded."""

from __future__ import annotations

import subprocess
import time

import pytest

from services.common import buffer, checkpoints
from services.common.release import decide
from tests.helpers import REPO
from tests.integration.trainer.data import PROMPTS, fill_buffer
from tests.integration.trainer.test_trainer_service import _adapter, _args, _copy_db, _train

pytestmark = pytest.mark.integration

AGENT = "default"
CANARY = ("algorithm.name=grpo", "release.mode=canary", "trainer.poll_interval_s=0.2")


def _distance(a: dict, b: dict) -> float:
    return float(sum((a[k] - b[k]).norm() ** 2 for k in a) ** 0.5)


def test_trainer_publishes_candidates_waits_and_continues_from_what_serves(tiny_model, sampled_db, ray_address, tmp_path):
    url = _copy_db(sampled_db, tmp_path)
    root = tmp_path / "ck"
    db = buffer.create_buffer_engine(url)

    _train(tiny_model, tmp_path, ray_address, *CANARY, "--max-steps", "1")
    assert checkpoints.read_candidate(root, AGENT) == 1 and checkpoints.read_latest(root, AGENT, fallback=False) == 0
    [d] = buffer.list_decisions(engine=db, agent=AGENT)
    assert (d.decision, d.actor, d.version) == ("candidate", "trainer", 1)
    assert checkpoints.validate_version(root, AGENT, 1).manifest()["release"][0]["decision"] == "candidate"

    # While v1 awaits its decision the Trainer trains nothing; rejected, it goes on from the base model.
    log_path = tmp_path / "waiting.log"
    with open(log_path, "w") as out:
        proc = subprocess.Popen(_args(tiny_model, tmp_path, ray_address, *CANARY, "--max-steps", "1"), cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while "training waits for its release decision" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(2.0)
        assert buffer.last_trainer_step(engine=db, agent=AGENT).step == 1
        decide(root=root, db=db, agent=AGENT, version=1, decision="rejected", serving=0, actor="test", reason="bad")
        assert proc.wait(240) == 0
    finally:
        proc.kill()
    log = log_path.read_text()
    assert "continuing from v0, the base model, with a fresh optimizer (it serves now; the learners were at v1)" in log
    assert checkpoints.read_candidate(root, AGENT) == 2
    assert checkpoints.validate_version(root, AGENT, 2).manifest()["parent_version"] == 0

    # v2 promoted, v3 trained from it and rejected: v4 descends from v2's own trainer state, not v3.
    decide(root=root, db=db, agent=AGENT, version=2, decision="promoted", serving=2, actor="test")
    _train(tiny_model, tmp_path, ray_address, *CANARY, "--max-steps", "1")
    assert checkpoints.read_candidate(root, AGENT) == 3 and checkpoints.read_latest(root, AGENT) == 2
    decide(root=root, db=db, agent=AGENT, version=3, decision="rejected", serving=2, actor="test")
    late = fill_buffer(url, tiny_model, n=2, prompts=PROMPTS[:4], model_version=3, seed=7)  # v3's calls, arriving late
    log = _train(tiny_model, tmp_path, ray_address, *CANARY, "--max-steps", "1")
    assert "continuing from v2, its own trainer state step-00000002 (it serves now; the learners were at v3)" in log
    manifest = checkpoints.validate_version(root, AGENT, 4).manifest()
    assert manifest["parent_version"] == 2
    v2, v3, v4 = (_adapter(tmp_path, v) for v in (2, 3, 4))
    # one step from v2 (as far from it as v3 is), not a second step on from v3 (which would put v4
    # nearer v3 than v2, and about twice as far from v2)
    assert _distance(v4, v2) < _distance(v4, v3) and _distance(v4, v2) < 1.5 * _distance(v3, v2)
    statuses = {buffer.get_experience(engine=db, experience_id=e.experience_id).status.value for e in late}
    assert statuses == {"discarded"}  # release.rejected_experiences=discard, recorded after the decision too
    assert "discarded 8 experiences of refused versions [3]" in log
    db.dispose()
