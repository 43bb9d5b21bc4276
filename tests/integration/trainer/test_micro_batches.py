"""How a step's batch is cut into micro-batches (trainer.micro_batch_size, micro_batch_tokens) changes its
memory and speed, never its update: the learner in this process (no Ray), on the tiny model, trains the
same GRPO batch with its demonstrations cut three ways and ends with the same adapter."""

from __future__ import annotations

import random

import pytest
import torch

from services.trainer.batches import Norms, TrainItem

pytestmark = pytest.mark.integration
LR = 1e-2


def _items(vocab: int) -> list[TrainItem]:
    """12 rollouts in 3 groups of 4 and 3 demonstrations, of lengths from 3 to 40 tokens."""
    rng = random.Random(0)
    items = []
    for i in range(15):
        prompt = [rng.randrange(10, vocab - 1) for _ in range(rng.randrange(2, 24))]
        response = [rng.randrange(10, vocab - 1) for _ in range(rng.randrange(1, 16))]
        demo = i >= 12
        items.append(TrainItem(experience_id=f"e{i}", task_id=f"t{i // 4}", run_id=str(i % 4), model_version=0,
                               prompt_ids=prompt, response_ids=response, old_logprobs=[-9.0] * len(response),
                               reward=None if demo else float(i % 2), temperature=1.0, seq=i, demonstration=demo,
                               advantage=None if demo else (1.0 if i % 2 else -1.0)))
    return items


def _train(model, items, trainer: dict) -> tuple[list[float], dict[str, torch.Tensor]]:
    from services.trainer.learner import LearnerWorker

    w = LearnerWorker({"model": {"path": str(model), "dtype": "float32"}, "trainer": {"device": "cpu", "torch_threads": 1, **trainer},
                       "algorithm": {"name": "grpo", "level": "token"}, "lora": {"r": 8},
                       "optim": {"lr": LR, "warmup_steps": 0}, "log_level": "warning"})
    w.setup()
    w.ensure_agent("a")
    losses = [float(w.train_step("a", items, Norms.of(items), step, 0).loss) for step in range(2)]
    return losses, w.policy.adapter_state("a")


def test_the_update_does_not_depend_on_how_the_batch_is_cut(tiny_model):
    import json

    items = _items(json.loads((tiny_model / "config.json").read_text())["vocab_size"])
    whole_loss, whole = _train(tiny_model, items, {"micro_batch_size": 64})
    for cut in ({"micro_batch_size": 3}, {"micro_batch_size": 64, "micro_batch_tokens": 60}):
        loss, state = _train(tiny_model, items, cut)
        assert loss == pytest.approx(whole_loss, rel=1e-4, abs=1e-6), cut
        assert any(float(v.abs().max()) > 1e-3 for v in state.values())  # it did move
        # Adam divides each gradient by its own scale, so where a gradient is near 0 the summation order's
        # float noise can move a weight by up to about lr: a few such elements, every other one equal
        diff = torch.cat([(state[k] - v).abs().flatten() for k, v in whole.items()])
        assert float((diff > 1e-6).float().mean()) < 0.005 and float(diff.max()) < 2 * LR, cut


def test_a_group_without_signal_costs_no_backward_and_changes_no_update(tiny_model):
    """Group t1's four runs scored alike (advantage 0): scored without gradients, the update and the step's
    figures are those of a step that ran a backward for them too (trainer.inert_backward)."""
    import json

    from services.trainer.learner import LearnerWorker

    items = _items(json.loads((tiny_model / "config.json").read_text())["vocab_size"])
    for it in items[4:8]:
        it.advantage, it.reward = 0.0, 1.0

    backwards = []
    real_backward = torch.autograd.backward

    def counted(*args, **kwargs):
        backwards.append(1)
        return real_backward(*args, **kwargs)

    def train(inert_backward: bool):
        backwards.clear()
        w = LearnerWorker({"model": {"path": str(tiny_model), "dtype": "float32"},
                           "trainer": {"device": "cpu", "torch_threads": 1, "micro_batch_size": 3, "inert_backward": inert_backward},
                           "algorithm": {"name": "grpo", "level": "token"}, "lora": {"r": 8},
                           "optim": {"lr": LR, "warmup_steps": 0}, "log_level": "warning"})
        w.setup()
        w.ensure_agent("a")
        torch.autograd.backward = counted
        try:
            steps = [w.train_step("a", items, Norms.of(items), step, 0) for step in range(2)]
        finally:
            torch.autograd.backward = real_backward
        return steps, w.policy.adapter_state("a"), len(backwards)

    skipped, state, fewer = train(False)
    computed, want, more = train(True)
    # micro-batches of 3 rows: the 12 calls together are 4 with a backward each; the 8 with signal are 3, and the
    # flat group's 4 calls 2 more without one. Per step one backward fewer (the demonstrations' the same on both)
    assert more - fewer == 2 and fewer > 0, (fewer, more)
    assert [s.inert_calls for s in skipped] == [4.0, 4.0] and [s.inert_calls for s in computed] == [0.0, 0.0]
    for a, b in zip(skipped, computed):
        for name in ("loss", "tokens", "entropy_sum", "mismatch_sum", "grad_norm"):
            assert getattr(a, name) == pytest.approx(getattr(b, name), rel=1e-4, abs=1e-6), name
        assert a.objective == pytest.approx(b.objective, rel=1e-4, abs=1e-6)
    diff = torch.cat([(state[k] - v).abs().flatten() for k, v in want.items()])
    assert any(float(v.abs().max()) > 1e-3 for v in state.values())  # it did move
    assert float((diff > 1e-6).float().mean()) < 0.005 and float(diff.max()) < 2 * LR
