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


def test_the_policy_as_teacher_scores_each_call_as_the_version_that_sampled_it(tiny_model, tmp_path):
    """A hinted call sampled by v1 and trained once the Trainer is at v2 is scored by v1 reading the
    hint (the published adapter, read by the learner), and the weights being trained are put back
    exactly; a version that cannot be read is scored as the adapter stands, and said so."""
    import torch

    from services.trainer.batches import Norms, TrainItem
    from services.trainer.learner import LearnerWorker, _Scorer
    from services.trainer.recipes.hints import teacher_inputs

    root = tmp_path / "ck"
    w = LearnerWorker({"model": {"path": str(tiny_model)}, "algorithm": {"name": "opd"},
                       "checkpoints": {"root": str(root)}, "log_level": "warning"})
    w.setup()
    w.ensure_agent("calc")
    w.policy.activate("calc")
    params = w.policy.adapter_parameters("calc")
    gen = torch.Generator().manual_seed(0)

    def nudge() -> None:
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.2)

    nudge()
    w.write_version("calc", str(root), 1, {"step": 1})
    assert w._live_version["calc"] == 1  # the weights are v1 exactly until the next update
    v1 = {k: v.clone() for k, v in w.policy.adapter_state("calc").items()}
    nudge()  # the Trainer has moved on: v2 is what it trains now
    now = {k: v.clone() for k, v in w.policy.adapter_state("calc").items()}
    tok = w.policy.tokenizer
    prompt = tok.encode("Hint: add them. What is 2 plus 3?", add_special_tokens=False)
    reply = tok.encode("The answer is 5.", add_special_tokens=False)

    def item(version: int, eid: str) -> TrainItem:
        return TrainItem(experience_id=eid, task_id=None, model_version=version, prompt_ids=prompt, response_ids=reply,
                         old_logprobs=[-1.0] * len(reply), reward=None, temperature=1.0, seq=0, teacher_prompt_ids=prompt)

    scorer = _Scorer(w.policy, 0, agent="calc", current_version=2, versions=w._published_adapter)
    x = teacher_inputs([item(1, "old"), item(2, "fresh"), item(7, "gone"), item(0, "base")], scorer, "policy")
    assert all(torch.equal(v, now[k]) for k, v in w.policy.adapter_state("calc").items())  # put back exactly
    as_now = scorer.logprobs([prompt], [reply], [1.0])[0]
    w.policy.load_adapter_state("calc", v1)
    as_v1 = scorer.logprobs([prompt], [reply], [1.0])[0]
    w.policy.load_adapter_state("calc", now)
    assert not torch.allclose(as_v1, as_now, atol=1e-3)  # the two versions disagree: the test can tell them apart
    assert torch.allclose(x["teacher"][0], as_v1, atol=1e-5)  # sampled by v1: v1 reads the hint
    assert torch.allclose(x["teacher"][1], as_now, atol=1e-5)  # sampled by the version trained now
    assert torch.allclose(x["teacher"][2], as_now, atol=1e-5)  # v7 was never published: as the adapter stands
    assert torch.allclose(x["teacher"][3], scorer.logprobs([prompt], [reply], [1.0], adapter=False)[0], atol=1e-5)  # v0: the base
    assert x["teacher_unmatched"].item() == 1.0 and scorer.has_version(1) and not scorer.has_version(7)
    # another adapter published as v3 (another alpha: kaizen publish) is not read as this policy: as the adapter stands
    shutil.copytree(root / "calc" / "v1", root / "calc" / "v3")
    config = json.loads((root / "calc" / "v3" / "adapter_config.json").read_text())
    (root / "calc" / "v3" / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 3 * config["lora_alpha"]}))
    manifest = json.loads((root / "calc" / "v3" / "manifest.json").read_text())
    (root / "calc" / "v3" / "manifest.json").write_text(json.dumps({**manifest, "version": 3}))
    assert not scorer.has_version(3)
    assert torch.allclose(teacher_inputs([item(3, "other")], scorer, "policy")["teacher"][0], as_now, atol=1e-5)
    # after an update the live weights are no published version: every version is read back, v2 too (unpublished here)
    demo = TrainItem(experience_id="d", task_id=None, model_version=0, prompt_ids=prompt, response_ids=reply, old_logprobs=[],
                     reward=0.0, temperature=1.0, seq=0, demonstration=True)
    w.train_step("calc", [demo], Norms.of([demo]), 0, 2)
    assert w._live_version["calc"] is None
