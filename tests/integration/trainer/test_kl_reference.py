"""algorithm.kl_reference cold_start: the KL penalty's reference is the agent's adapter as its cold start
left it, kept with the Trainer's saved state. The learner in this process (no Ray), on the tiny model:
two supervised steps on demonstrations (the cold start), then GRPO steps on rollouts."""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch

from services.trainer.batches import Norms, TrainItem

pytestmark = pytest.mark.integration
COLD = 2  # cold_start_steps


def _items(vocab: int, seed: int, *, rollouts: int = 8) -> list[TrainItem]:
    """``rollouts`` calls in groups of 4 (advantage +-1) and 3 demonstrations."""
    rng = random.Random(seed)
    items = []
    for i in range(rollouts + 3):
        demo = i >= rollouts
        prompt = [rng.randrange(10, vocab - 1) for _ in range(rng.randrange(4, 12))]
        response = [rng.randrange(10, vocab - 1) for _ in range(rng.randrange(2, 8))]
        items.append(TrainItem(experience_id=f"{seed}-{i}", task_id=f"t{i // 4}", run_id=str(i % 4), model_version=0,
                               prompt_ids=prompt, response_ids=response, old_logprobs=[-5.0] * len(response),
                               reward=None if demo else float(i % 2), temperature=1.0, seq=i, demonstration=demo,
                               advantage=None if demo else (1.0 if i % 2 else -1.0)))
    return items


def _worker(model, reference: str, kl_coef: float = 0.5):
    from services.trainer.learner import LearnerWorker

    w = LearnerWorker({"model": {"path": str(model), "dtype": "float32"}, "trainer": {"device": "cpu", "torch_threads": 1},
                       "algorithm": {"name": "grpo", "kl_coef": kl_coef, "kl_reference": reference, "cold_start_steps": COLD},
                       "lora": {"r": 8}, "optim": {"lr": 1e-2, "warmup_steps": 0}, "log_level": "warning"})
    w.setup()
    return w


def _kl(stats) -> float:
    return stats.kl_sum / stats.tokens


@pytest.fixture(scope="module")
def vocab(tiny_model) -> int:
    return json.loads((tiny_model / "config.json").read_text())["vocab_size"]


def _cold_start(w, vocab: int) -> dict[str, torch.Tensor]:
    """The cold start's steps (demonstrations only); returns the adapter they left."""
    w.ensure_agent("a")
    demos = [i for i in _items(vocab, 0) if i.demonstration]
    for step in range(COLD):
        w.train_step("a", demos, Norms.of(demos), step, 0)
    return {n: p.detach().clone() for n, p in w.policy.adapter_named_parameters("a").items()}


def test_the_reference_is_the_cold_starts_adapter_and_survives_a_restart(tiny_model, vocab, tmp_path):
    w = _worker(tiny_model, "cold_start")
    cold = _cold_start(w, vocab)
    assert all(torch.equal(w._reference["a"][k], v) for k, v in cold.items())  # the cold start's last step left it
    first = _items(vocab, 1)
    s2 = w.train_step("a", first, Norms.of(first), COLD, 0)
    # the first step past the cold start starts on the reference itself: no divergence from it yet ...
    assert _kl(s2) == pytest.approx(0.0, abs=1e-6) and s2.kl_loss == pytest.approx(0.0, abs=1e-6)
    assert all(torch.equal(w._reference["a"][k], v) for k, v in cold.items())
    # ... while against the base model (the other reference) the same weights had moved
    base = _worker(tiny_model, "base")
    assert _cold_start(base, vocab).keys() == cold.keys()
    assert _kl(base.train_step("a", first, Norms.of(first), COLD, 0)) > 1e-3

    # the next step sees how far the update went from the cold start; the reference itself did not move
    state = w.save_state("a", str(tmp_path / "state"), {"step": COLD + 1})
    second = _items(vocab, 2)
    s3 = w.train_step("a", second, Norms.of(second), COLD + 1, 0)
    assert _kl(s3) > 1e-4 and s3.kl_loss > 0
    assert all(torch.equal(w._reference["a"][k], v) for k, v in cold.items())

    # a restarted learner reads the reference back with the state, and takes the same step
    again = _worker(tiny_model, "cold_start")
    again.ensure_agent("a", state_dir=state)
    assert all(torch.equal(again._reference["a"][k], v) for k, v in cold.items())
    r3 = again.train_step("a", second, Norms.of(second), COLD + 1, 0)
    assert (r3.kl_sum, r3.loss) == pytest.approx((s3.kl_sum, s3.loss), rel=1e-5, abs=1e-7)
    for k, v in w.policy.adapter_state("a").items():
        assert torch.allclose(again.policy.adapter_state("a")[k], v, atol=1e-6), k


def test_a_cold_start_step_with_rollouts_has_no_penalty_and_the_state_after_the_cold_start_holds_the_reference(
        tiny_model, vocab, tmp_path):
    w = _worker(tiny_model, "cold_start")
    w.ensure_agent("a")
    demos = [i for i in _items(vocab, 0) if i.demonstration]
    w.train_step("a", demos, Norms.of(demos), 0, 0)
    mixed = _items(vocab, 5)  # rollouts in the cold start's last step: no reference yet, so no KL figure and no penalty
    s = w.train_step("a", mixed, Norms.of(mixed), COLD - 1, 0)
    assert s.kl_sum is None and s.kl_loss is None and s.tokens > 0
    cold = {n: p.detach().clone() for n, p in w.policy.adapter_named_parameters("a").items()}
    assert all(torch.equal(w._reference["a"][k], v) for k, v in cold.items())
    state = w.save_state("a", str(tmp_path / "state"), {"step": COLD})  # the state a rollback to the cold start reads
    again = _worker(tiny_model, "cold_start")
    again.ensure_agent("a", state_dir=state)
    assert all(torch.equal(again._reference["a"][k], v) for k, v in cold.items())


def test_the_penalty_pulls_the_update_toward_the_reference(tiny_model, vocab):
    """From the same weights, the same batches with the penalty end nearer the cold start's policy (its
    KL to them, measured by a fourth step's forward on one batch) than without it."""
    kl = {}
    for coef in (0.0, 5.0):
        w = _worker(tiny_model, "cold_start", kl_coef=coef)
        _cold_start(w, vocab)
        for step, seed in ((COLD, 1), (COLD + 1, 2), (COLD + 2, 3)):
            items = _items(vocab, seed)
            w.train_step("a", items, Norms.of(items), step, 0)
        last = _items(vocab, 4)
        kl[coef] = _kl(w.train_step("a", last, Norms.of(last), COLD + 3, 0))
    assert 0 < kl[5.0] < 0.5 * kl[0.0], kl


def test_a_learner_past_its_cold_start_without_a_saved_reference_takes_its_weights_and_says_so(tiny_model, vocab, tmp_path):
    plain = _worker(tiny_model, "base")
    _cold_start(plain, vocab)
    items = _items(vocab, 1)
    plain.train_step("a", items, Norms.of(items), COLD, 0)
    state = plain.save_state("a", str(tmp_path / "state"), {"step": COLD + 1})  # a state with no reference in it
    now = {n: p.detach().clone() for n, p in plain.policy.adapter_named_parameters("a").items()}

    w = _worker(tiny_model, "cold_start")
    w.ensure_agent("a", state_dir=state)
    said: list[str] = []
    listener = logging.Handler(logging.WARNING)  # on the learner's logger: the worker's set-up replaced the root's handlers
    listener.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("services.trainer.learner").addHandler(listener)
    try:
        s = w.train_step("a", items, Norms.of(items), COLD + 1, 0)
    finally:
        logging.getLogger("services.trainer.learner").removeHandler(listener)
    assert any("no saved KL reference" in m and "at step 3" in m for m in said), said
    assert all(torch.equal(w._reference["a"][k], v) for k, v in now.items())
    assert _kl(s) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("reference", ["base", "cold_start"])
def test_the_reference_is_scored_once_a_step_whatever_its_epochs(tiny_model, vocab, reference, monkeypatch):
    """Three epochs: the reference's forward (without gradients) runs once per micro-batch, the policy's three
    times, and the step's KL figure is the mean of its epochs' against that one reference."""
    from services.trainer.learner import LearnerWorker

    w = LearnerWorker({"model": {"path": str(tiny_model), "dtype": "float32"},
                       "trainer": {"device": "cpu", "torch_threads": 1, "epochs": 3},
                       "algorithm": {"name": "grpo", "kl_coef": 0.5, "kl_reference": reference, "cold_start_steps": COLD},
                       "lora": {"r": 8}, "optim": {"lr": 1e-2, "warmup_steps": 0}, "log_level": "warning"})
    w.setup()
    _cold_start(w, vocab)
    rollouts = [i for i in _items(vocab, 1) if not i.demonstration]
    forwards, real = [], w.policy.forward

    def counted(batch, **kw):
        forwards.append(torch.is_grad_enabled())
        return real(batch, **kw)

    monkeypatch.setattr(w.policy, "forward", counted)
    stats = w.train_step("a", rollouts, Norms.of(rollouts), COLD, 0)
    assert forwards == [False, True, True, True], forwards  # one micro-batch: the reference once, then three epochs
    assert _kl(stats) > 0
