"""Hints through the real `kaizen trainer` (recipe opd): calls that carry a hint and no reward are
trained towards the teacher that read the hint, the teacher's cost and the distillation figures are in
every step record, and calls without a hint are set aside."""

from __future__ import annotations

import json
import shutil
import sqlite3

import pytest
from pytest import approx

from services.common import buffer, checkpoints
from tests.integration.trainer.test_new_objective import PREFIX
from tests.integration.trainer.test_trainer_service import _train

pytestmark = pytest.mark.integration


def _reverse_kl(model, rows, *, adapter: bool) -> float:
    """Mean KL(student || teacher) over the vocabulary at each trained response position: what OPD
    lowers (its per-token advantage is an estimate of minus this on one sample). The teacher is the base
    model after PREFIX, the student the model with (``adapter``) or without the trained adapter."""
    import torch

    def dist(prompt, response, use_adapter):
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            if use_adapter:
                logits = model(input_ids=ids).logits
            else:
                with model.disable_adapter():
                    logits = model(input_ids=ids).logits
        return torch.log_softmax(logits[0, len(prompt) - 1 : -1].float(), -1)

    total = positions = 0
    for r in rows:
        s = dist(r.prompt_token_ids, r.response_token_ids, adapter)
        t = dist(PREFIX + r.prompt_token_ids, r.response_token_ids, False)
        total, positions = total + float((s.exp() * (s - t)).sum()), positions + s.shape[0]
    return total / positions


@pytest.mark.parametrize("top_k", [16])  # 0 (the sampled tokens alone): 0.20 -> 0.15, measured once
def test_opd_moves_the_agent_towards_the_teacher_that_read_the_hint(top_k, tiny_model, sampled_db, ray_address, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tmp_path.mkdir(parents=True, exist_ok=True)
    shutil.copy(sampled_db, tmp_path / "buffer.db")
    with sqlite3.connect(tmp_path / "buffer.db") as con:  # hints alone (the teacher reads PREFIX first), no reward
        con.execute("UPDATE experiences SET reward = NULL")
        rows = con.execute("SELECT experience_id, prompt_token_ids, task_id FROM experiences ORDER BY seq").fetchall()
        for exp_id, prompt, task in rows:
            hint = None if task == rows[0][2] else {"text": "think first", "prompt_token_ids": PREFIX + json.loads(prompt)}
            con.execute("UPDATE experiences SET hint = ? WHERE experience_id = ?", (json.dumps(hint), exp_id))
    steps = 2
    # the teacher: a model of its own, by path (here the same weights as the base: the measure's teacher)
    log = _train(tiny_model, tmp_path, ray_address, "algorithm.name=opd", f"algorithm.opd.teacher={tiny_model}",
                 "optim.lr=1e-3",
                 f"algorithm.opd.top_k={top_k}", "trainer.epochs=2", "--max-steps", str(steps))
    assert "published v2" in log
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        assert {"hinted_share", "distill_advantage", "teacher_s"} <= set(r["objective_figures"])
        assert r["hinted_share"] == approx(1.0) and r["teacher_s"] > 0 and r["distill_advantage"] < 0
        assert ("teacher_kl" in r) == bool(top_k)
    db = buffer.create_buffer_engine(f"sqlite:///{tmp_path}/buffer.db")
    first_task = [buffer.get_experience(engine=db, experience_id=e) for e, _, task in rows if task == rows[0][2]]
    assert first_task and {e.status.value for e in first_task} == {"discarded"}  # no hint: set aside
    trained = [buffer.get_experience(engine=db, experience_id=e) for e, _ in buffer.consumed_ids(engine=db)]
    db.dispose()
    assert len(trained) == 16 * steps and all(t.hint for t in trained)
    v = checkpoints.validate_version(tmp_path / "ck", "default", steps)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(v.path))
    # measured once: 0.20 -> 0.15 sampled tokens alone, -> 0.10 with the top 16 (the sampled tokens' own gaps
    # overshoot: one sample per position)
    before, after = _reverse_kl(model, trained, adapter=False), _reverse_kl(model, trained, adapter=True)
    print(f"reverse KL to the teacher, top_k={top_k}: {before:.3f} -> {after:.3f}")
    assert after < 0.9 * before, (before, after)


def test_a_teacher_that_does_not_share_the_agents_tokenizer_is_refused(tiny_model, tmp_path):
    from services.common.tiny_model import build_tiny_model
    from services.trainer.learner import LearnerWorker

    other = build_tiny_model(tmp_path / "other", seed=7)  # another tokenizer (trained on another corpus)
    w = LearnerWorker({"model": {"path": str(tiny_model)}, "trainer": {"device": "cpu", "torch_threads": 1},
                       "algorithm": {"name": "opd", "opd": {"teacher": str(other)}}, "log_level": "warning"})
    w.setup()
    with pytest.raises(ValueError, match="does not share the agent's tokenizer"):
        w._other_model(str(other))
    assert w._other_model(str(tiny_model)).model is None  # the same tokenizer: loaded, without adapters
