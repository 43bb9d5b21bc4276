"""The Trainer's step on CUDA (skipped without a GPU: CI has none; run by hand on a GPU machine with
`python -m pytest tests/gpu`, which needs torch, transformers, peft, pydantic and SQLAlchemy, no Ray).

The learner runs in this process (as the demo's control arm runs it), on the tiny model built here: a
GRPO step and an opd step with the teacher's top-k give the CPU's figures and adapter in float32, and
stay close in bfloat16. ``KAIZEN_GPU_TEST_DEVICE=cpu`` runs them against the CPU itself (a check of
the test, not of a GPU)."""

from __future__ import annotations

import os
import random

import pytest
import torch

DEVICE = os.environ.get("KAIZEN_GPU_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="no CUDA device")]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from services.common.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("gpu") / "tiny")


def _worker(model, device: str, dtype: str, algorithm: dict, chain: bool = True):
    from services.trainer.learner import LearnerWorker

    w = LearnerWorker({"model": {"path": str(model), "dtype": dtype},
                       "trainer": {"device": device, "torch_threads": 2, "chain_calls": chain},
                       "algorithm": algorithm, "lora": {"r": 8}, "optim": {"lr": 1e-3, "warmup_steps": 0},
                       "log_level": "warning"})
    w.setup()
    w.ensure_agent("a")
    return w


def _items(model, hinted: bool):
    """16 calls of 4 groups, their recorded logprobs those of the base model (as if it had sampled them)."""
    import json

    from services.trainer.batches import TrainItem
    from services.trainer.learner import _Scorer

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    items = []
    for i in range(16):
        prompt = [rng.randrange(10, vocab - 1) for _ in range(rng.randrange(8, 24))]
        response = [rng.randrange(10, vocab - 1) for _ in range(rng.randrange(4, 12))]
        items.append(TrainItem(experience_id=f"e{i}", task_id=f"t{i // 4}", run_id=str(i % 4), model_version=0,
                               prompt_ids=prompt, response_ids=response, old_logprobs=[], reward=float(i % 2),
                               temperature=1.0, advantage=1.0 if i % 2 else -1.0,
                               teacher_prompt_ids=[7, 11, 13, 17] + prompt if hinted else None))
    base = _worker(model, "cpu", "float32", {"name": "grpo"})
    lp = _Scorer(base.policy, 0).logprobs([i.prompt_ids for i in items], [i.response_ids for i in items], [1.0] * 16)
    for k, it in enumerate(items):
        it.old_logprobs = lp[k, :len(it.response_ids)].tolist()
    return items


def _steps(w, items, n=3):
    from services.trainer.batches import Norms

    out = []
    for step in range(n):
        st = w.train_step("a", items, Norms.of(items), step, 0)
        out.append({"loss": float(st.loss), "grad_norm": float(st.grad_norm), **{k: float(v) for k, v in st.objective.items()}})
    return out, w.policy.adapter_state("a")


@pytest.mark.parametrize("algorithm, hinted", [
    ({"name": "grpo"}, False),
    ({"name": "opd", "opd": {"top_k": 16, "teacher": "base"}}, True),
])
def test_a_step_on_the_gpu_gives_the_cpus_figures_and_adapter(model, algorithm, hinted):
    items = _items(model, hinted)
    cpu, cpu_state = _steps(_worker(model, "cpu", "float32", algorithm), items)
    gpu, gpu_state = _steps(_worker(model, DEVICE, "float32", algorithm), items)
    for a, b in zip(cpu, gpu):
        assert a.keys() == b.keys()
        for k in (k for k in a if not k.endswith("_s")):  # times differ, of course
            assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-5), (k, a[k], b[k])
    for k, v in cpu_state.items():  # Adam turns a float's noise in a near-zero gradient into up to ~lr/10
        torch.testing.assert_close(gpu_state[k], v, rtol=1e-3, atol=1e-4)
    half, _ = _steps(_worker(model, DEVICE, "bfloat16", algorithm), items)
    for a, b in zip(cpu, half):
        assert all(torch.isfinite(torch.tensor(v)) for v in b.values()), b
        assert b["loss"] == pytest.approx(a["loss"], rel=0.05, abs=2e-3), (a["loss"], b["loss"])


def _episodes(model):
    """8 episodes of three calls (2 groups of 4), each call's prompt the last call's prompt, its response
    and a tool's result, as the Explorer records a tool loop; recorded logprobs a constant (the ratio is
    then not 1, so the clip's path is exercised too)."""
    import json

    from services.trainer.batches import TrainItem

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(1)
    ids = lambda n: [rng.randrange(10, vocab - 1) for _ in range(n)]  # noqa: E731
    items = []
    for e in range(8):
        prompt = ids(rng.randrange(8, 24))
        for call in range(3):
            response = ids(rng.randrange(2, 10))
            items.append(TrainItem(experience_id=f"e{e}-{call}", task_id=f"t{e // 4}", run_id=str(e % 4), model_version=0,
                                   prompt_ids=prompt, response_ids=response, old_logprobs=[-6.5] * len(response),
                                   reward=float(e % 2), temperature=1.0, advantage=1.0 if e % 2 else -1.0, seq=3 * e + call))
            prompt = prompt + response + ids(rng.randrange(3, 9))
    return items


def test_chained_calls_on_the_gpu_train_as_one_row_each(model):
    """trainer.chain_calls on CUDA: an episode's three calls in one row (its padding, positions and the
    LM head on the calls' tokens alone, packed) give the figures and adapter of one row per call, in
    float32 and near them in bfloat16."""
    items = _episodes(model)
    chained_worker = _worker(model, DEVICE, "float32", {"name": "grpo"})
    assert chained_worker._pack(items).input_ids.shape[0] == 8  # an episode a row
    plain_worker = _worker(model, DEVICE, "float32", {"name": "grpo"}, chain=False)
    start = {k: v.clone() for k, v in plain_worker.policy.adapter_state("a").items()}
    plain, plain_state = _steps(plain_worker, items)
    chained, chained_state = _steps(chained_worker, items)
    for a, b in zip(plain, chained):
        for k in (k for k in a if not k.endswith("_s")):
            assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-5), (k, a[k], b[k])
    # the updates, not each element: other shapes take other cuBLAS kernels, and Adam turns their
    # rounding in a near-zero gradient into a step of up to lr either way (seen: 2 of 8,192 elements)
    for k, v in plain_state.items():
        update, off = (v - start[k]).norm(), (chained_state[k] - v).norm()
        assert off <= 1e-2 * update + 1e-6, (k, float(off), float(update))
    half, _ = _steps(_worker(model, DEVICE, "bfloat16", {"name": "grpo"}), items)
    for a, b in zip(plain, half):
        assert b["loss"] == pytest.approx(a["loss"], rel=0.05, abs=2e-3), (a["loss"], b["loss"])
