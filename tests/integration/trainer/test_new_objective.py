"""The recipe seam is real: an objective written here, in this test module alone (one recipe, one
pure loss, no change anywhere in services/), is named in the config, loaded in the Trainer and in
its Ray learner, and trained end to end by the real `kaizen trainer`.

The objective is a small distillation on the agent's own samples: the teacher is the base model
reading a prefix before each prompt (privileged context), the student the agent without it; each
sampled token's logprob is pulled toward the teacher's. It needs no reward (the rows have none),
declares its own config section (``algorithm.prefix_distill``), asks the learner for an extra input
(the teacher's logprobs) and reports a statistic of its own (``teacher_gap``).
"""

from __future__ import annotations

import json
import shutil
import sqlite3

import pytest
import torch
from pydantic import Field
from pytest import approx

from services.common import buffer, checkpoints
from services.trainer.algorithms.masking import aggregate
from services.trainer.recipes import BaseRecipe, MicroBatch, RecipeConfig
from tests.integration.trainer.test_trainer_service import _train

pytestmark = pytest.mark.integration


def distill_loss(*, logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor,
                 normalizer: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Pull each sampled token's logprob toward the teacher's: sum(0.5 * (student - teacher)^2) /
    normalizer, no gradient into the teacher. Shapes (B, R)."""
    diff = logprobs - teacher_logprobs.detach()
    loss = aggregate(0.5 * diff**2, mask, normalizer)
    return loss, {"loss": loss.detach(), "teacher_gap": aggregate(diff.detach().abs(), mask, normalizer)}


def test_distill_loss_by_hand():
    # student -1 and -2, teacher -0.5 and -3: differences -0.5 and +1.0;
    # loss = (0.5 * 0.25 + 0.5 * 1) / 2 = 0.3125; gap = (0.5 + 1.0) / 2 = 0.75
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, stats = distill_loss(logprobs=lp, teacher_logprobs=torch.tensor([[-0.5, -3.0]]), mask=torch.ones(1, 2), normalizer=2)
    assert loss.item() == approx(0.3125) and stats["teacher_gap"].item() == approx(0.75)
    loss.backward()  # d loss / d lp = difference / 2: up where the teacher is higher, down where it is lower
    assert lp.grad.tolist() == [[approx(-0.25), approx(0.5)]]


class PrefixDistillConfig(RecipeConfig):
    prefix_ids: list[int] = Field(min_length=1, description="Token ids the teacher reads before each prompt.")


class PrefixDistill(BaseRecipe):
    name = "prefix_distill"
    Config = PrefixDistillConfig
    needs_reward = False
    config: PrefixDistillConfig

    def extra_inputs(self, items, scorer):
        prompts = [self.config.prefix_ids + i.prompt_ids for i in items]
        teacher = scorer.logprobs(prompts, [i.response_ids for i in items], [i.temperature for i in items], adapter=False)
        return {"teacher_logprobs": teacher}

    def loss(self, mb: MicroBatch):
        return distill_loss(logprobs=mb.logprobs, teacher_logprobs=mb.extra["teacher_logprobs"], mask=mb.mask,
                            normalizer=mb.norms.tokens)


PREFIX = [7, 11, 13, 17, 19, 23, 29, 31]


def _logprobs(model, prompt: list[int], response: list[int], *, adapter: bool) -> torch.Tensor:
    with torch.no_grad():
        if adapter:
            logits = model(input_ids=torch.tensor([prompt + response])).logits
        else:
            with model.disable_adapter():
                logits = model(input_ids=torch.tensor([prompt + response])).logits
    logits = logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1)


def _gap(model, rows, *, adapter: bool) -> float:
    """Mean |teacher - student| logprob over the rows' response tokens; the teacher is the base
    model after PREFIX, the student the model with (``adapter``) or without the trained adapter."""
    total = sum(float((_logprobs(model, PREFIX + r.prompt_token_ids, r.response_token_ids, adapter=False)
                       - _logprobs(model, r.prompt_token_ids, r.response_token_ids, adapter=adapter)).abs().sum())
                for r in rows)
    return total / sum(len(r.response_token_ids) for r in rows)


def test_an_objective_from_this_module_trains_end_to_end(tiny_model, sampled_db, ray_address, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tmp_path.mkdir(parents=True, exist_ok=True)
    shutil.copy(sampled_db, tmp_path / "buffer.db")
    with sqlite3.connect(tmp_path / "buffer.db") as con:  # rows without rewards: only this objective can use them
        con.execute("UPDATE experiences SET reward = NULL")
    steps = 2
    log = _train(tiny_model, tmp_path, ray_address, f"algorithm.name={__name__}:PrefixDistill",
                 f"algorithm.prefix_distill.prefix_ids={json.dumps(PREFIX)}", "optim.lr=1e-3", "trainer.epochs=2",
                 "--max-steps", str(steps))
    assert "published v2" in log
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # the objective's own statistic flows through the learner, the step record and the buffer unnamed
    assert [r["objective_figures"] for r in records] == [["teacher_gap"]] * steps
    assert all(isinstance(r["teacher_gap"], float) and r["reward_mean"] is None for r in records)
    db = buffer.create_buffer_engine(f"sqlite:///{tmp_path}/buffer.db")
    assert [s["teacher_gap"] for s in _step_metrics(db)] == [r["teacher_gap"] for r in records]
    consumed = [e for e, _ in buffer.consumed_ids(engine=db)]
    rows = [r for r in buffer.fetch_committed(engine=db, agent="default", limit=100_000)]  # the rest, untouched
    assert len(consumed) == 16 * steps and len(rows) == 192 - 16 * steps
    trained = [buffer.get_experience(engine=db, experience_id=e) for e in consumed]
    db.dispose()
    v = checkpoints.validate_version(tmp_path / "ck", "default", steps)
    assert v.manifest()["algorithm"] == f"{__name__}:PrefixDistill"
    # and it learned what it was asked: the student moved toward the teacher on the tokens it trained on
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(v.path))
    before, after = _gap(model, trained, adapter=False), _gap(model, trained, adapter=True)
    assert after < 0.95 * before, (before, after)


def _step_metrics(db) -> list[dict]:
    with db.connect() as conn:
        return [json.loads(m) if isinstance(m, str) else m
                for (m,) in conn.exec_driver_sql("SELECT metrics FROM trainer_steps ORDER BY id").all()]
