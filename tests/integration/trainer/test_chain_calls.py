"""An episode's calls scored in one row (trainer.chain_calls): the same step as one row per call, on the
real learner and the tiny model in float32: the same losses, statistics and updated adapter, from
fewer rows. Each episode's second call's prompt holds its first call, that call's response and a
tool's result, as the Explorer records a tool loop."""

from __future__ import annotations

import pytest
import torch

from services.trainer.batches import Norms, TrainItem
from services.trainer.learner import LearnerWorker

pytestmark = pytest.mark.integration

AGENT = "calc"


def _episodes(tok) -> list[TrainItem]:
    items, seq = [], 0
    for task, question in enumerate(["What is 2 plus 3?", "What is 7 times 6?"]):
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                    tokenize=False), add_special_tokens=False)
        for run, (call, answer, reward) in enumerate([("calc(2+3)", "It is 5.", 1.0), ("calc(2*3)", "It is 6.", 0.0)]):
            first = tok.encode(call, add_special_tokens=False)
            tool = tok.encode(f" result: {answer[6:-1]} ", add_special_tokens=False)
            second_prompt = prompt + first + tool
            for k, (p, r) in enumerate([(prompt, first), (second_prompt, tok.encode(answer, add_special_tokens=False))]):
                items.append(TrainItem(experience_id=f"{task}-{run}-{k}", task_id=str(task), model_version=0, prompt_ids=p,
                                       response_ids=r, old_logprobs=[-1.0] * len(r), reward=reward, temperature=1.0,
                                       seq=seq, advantage=1.0 if reward else -1.0, run_id=str(run)))
                seq += 1
    # the demonstrations of the mixed objective: one two-call episode as well
    demo = [TrainItem(experience_id=f"d-{k}", task_id=None, model_version=0, prompt_ids=it.prompt_ids,
                      response_ids=it.response_ids, old_logprobs=[], reward=None, temperature=1.0, seq=100 + k,
                      demonstration=True) for k, it in enumerate(items[:2])]
    return items + demo


def _worker(tiny_model, chain: bool) -> LearnerWorker:
    w = LearnerWorker({"model": {"path": str(tiny_model), "dtype": "float32"}, "algorithm": {"name": "grpo"},
                       "optim": {"lr": 1e-3}, "trainer": {"chain_calls": chain}, "log_level": "warning"})
    w.setup()
    w.ensure_agent(AGENT)
    return w


def test_chained_calls_train_exactly_as_one_row_each(tiny_model):
    plain, chained = _worker(tiny_model, False), _worker(tiny_model, True)
    items = _episodes(chained.policy.tokenizer)
    rollouts = [i for i in items if not i.demonstration]
    start = {k: v.clone() for k, v in plain.policy.adapter_state(AGENT).items()}
    assert all(torch.equal(start[k], v) for k, v in chained.policy.adapter_state(AGENT).items())  # the same seed

    # the chained layout: each episode one row (4 episodes), the demonstrations' episode one row
    chunks = chained._length_chunks(rollouts)
    assert sum(len(c) for c in chunks) == len(rollouts)
    assert sum(chained._pack(c).input_ids.shape[0] for c in chunks) == 4
    assert plain._pack(rollouts).input_ids.shape[0] == 8 and plain._pack(rollouts).chain is None

    [(a, mask_a)], [(b, mask_b)] = plain._sampled_logprobs(rollouts), chained._sampled_logprobs(rollouts)
    # the two calls' orders may differ by micro-batch: compare each call's own logprobs
    by_id = lambda w, lp: {it.experience_id: lp[row, : len(it.response_ids)]  # noqa: E731
                           for chunk in w._length_chunks(rollouts) for row, it in enumerate(chunk)}
    pa, pb = by_id(plain, a), by_id(chained, b)
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], atol=1e-5, rtol=1e-5)

    sa = plain.train_step(AGENT, items, Norms.of(items), 0, 0)
    sb = chained.train_step(AGENT, items, Norms.of(items), 0, 0)
    for f in ("loss", "entropy_sum", "tokens", "demo_nll", "mismatch_sum", "grad_norm"):
        assert getattr(sb, f) == pytest.approx(getattr(sa, f), rel=1e-4, abs=1e-5), f
    # the same gradient (compared before Adam, whose first step maps a gradient element's sign, float noise
    # included, to a full lr-sized move), and an update made from it
    grads_a = [q.grad for q in plain.policy.adapter_parameters(AGENT)]
    grads_b = [q.grad for q in chained.policy.adapter_parameters(AGENT)]
    assert len(grads_a) == len(grads_b) and any(float(g.abs().max()) > 0 for g in grads_a)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(gb, ga, atol=1e-6, rtol=1e-4)
    after = plain.policy.adapter_state(AGENT)
    assert any(not torch.equal(start[k], after[k]) for k in start)
