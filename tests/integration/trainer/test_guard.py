"""The Trainer's guard (TrainerConfig.guard): an update that makes the agent much worse at its own
demonstrations, or (guard.max_kl) moves its policy too far on the step's own samples, is undone,
weights and optimizer state, and redone at half the learning rate; when every attempt is refused
the step keeps the weights it started from. Real learner, tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.batches import Norms, TrainItem
from services.trainer.learner import LearnerWorker

pytestmark = pytest.mark.integration

AGENT = "calc"
QUESTIONS = [f"What is {a} plus {b}?" for a, b in [(2, 3), (4, 1), (6, 2), (7, 1)]]


def _demos(tok, answer) -> list[TrainItem]:
    out = []
    for k, q in enumerate(QUESTIONS):
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                    tokenize=False), add_special_tokens=False)
        out.append(TrainItem(experience_id=f"{answer(k)}-{k}", task_id=None, model_version=0, prompt_ids=prompt,
                             response_ids=tok.encode(answer(k), add_special_tokens=False), old_logprobs=[], reward=0.0,
                             temperature=1.0, seq=k, demonstration=True))
    return out


def _nll(worker: LearnerWorker, demos: list[TrainItem]) -> float:
    total, tokens = worker._nll_sums(demos)
    return total / tokens


def _state(worker: LearnerWorker) -> tuple[dict[str, torch.Tensor], int]:
    adapter = {k: v.clone() for k, v in worker.policy.adapter_state(AGENT).items()}
    steps = [int(s["step"]) for s in worker.optimizers[AGENT].state_dict()["state"].values()]
    return adapter, max(steps, default=0)


@pytest.fixture(scope="module")
def worker(tiny_model):
    w = LearnerWorker({"model": {"path": str(tiny_model)}, "algorithm": {"name": "grpo"}, "optim": {"lr": 3e-3},
                       "guard": {"max_ratio": 2.0, "slack": 0.01, "retries": 1}, "log_level": "warning"})
    w.setup()
    w.ensure_agent(AGENT)
    tok = w.policy.tokenizer
    good = _demos(tok, lambda k: f"The answer is {k}.")
    for step in range(30):  # learn the demonstrations (no guard)
        w.train_step(AGENT, good, Norms.of(good), step, 0)
    return w, good, _demos(tok, lambda k: "I refuse to say, sorry!")


def test_an_update_that_wrecks_the_demonstrations_is_refused_and_undone(worker):
    w, good, bad = worker
    before, opt_steps = _state(w)
    nll = _nll(w, good)
    assert nll < 0.05, f"the demonstrations were not learnt (nll {nll:.3f}): the test needs them learnt"
    for g in w.optimizers[AGENT].param_groups:
        g["lr"] = 0.5
    w.cfg.optim.lr = 0.5  # a huge step towards other answers
    try:
        st = w.train_step(AGENT, bad, Norms.of(bad), 100, 0, guard=good)
    finally:
        w.cfg.optim.lr = 3e-3
    assert st.guard_refused == 1.0 and st.guard_attempts == 2.0
    assert st.guard_before == pytest.approx(nll, rel=1e-4)
    assert st.guard_after > 2.0 * st.guard_before + 0.01
    assert st.lr == pytest.approx(0.25)  # the retry ran at half the learning rate
    after, opt_steps_after = _state(w)
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused step changed the adapter"
    assert opt_steps_after == opt_steps, "a refused step advanced the optimizer state"
    assert _nll(w, good) == pytest.approx(nll, rel=1e-5)


def test_an_ordinary_update_passes_the_guard_and_moves_the_weights(worker):
    w, good, _ = worker
    before, opt_steps = _state(w)
    nll = _nll(w, good)
    st = w.train_step(AGENT, good, Norms.of(good), 101, 0, guard=good)
    assert st.guard_attempts == 1.0 and st.guard_refused is None
    assert st.guard_before == pytest.approx(nll, rel=1e-4)
    assert st.guard_after <= 2.0 * st.guard_before + 0.01
    after, opt_steps_after = _state(w)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert opt_steps_after == opt_steps + 1
    # the next step starts from the NLL this one measured (no second scoring of the same weights)
    [(part, (total, tokens))] = w._guard_nll[AGENT].items()
    assert part == {d.experience_id for d in good} and total / tokens == st.guard_after


def test_a_guard_set_that_grows_scores_only_its_new_members(worker):
    w, good, _ = worker
    first, grown = good[:2], good
    w.train_step(AGENT, good, Norms.of(good), 103, 0, guard=first)  # its "after": the first two on these weights
    whole = _nll(w, grown)  # the grown set scored at once, by hand, on the same weights
    real, scored = w._nll_sums, []
    w._nll_sums = lambda demos: scored.append([d.experience_id for d in demos]) or real(demos)
    try:
        st = w.train_step(AGENT, good, Norms.of(good), 104, 0, guard=grown)
        assert scored == [[d.experience_id for d in good[2:]], [d.experience_id for d in grown]]  # before, after
        assert st.guard_before == pytest.approx(whole, rel=1e-5)
        # a member gone (a demonstration deleted): what is left is scored afresh, as one set
        scored.clear()
        shrunk = grown[1:]
        whole = _nll(w, shrunk)
        st = w.train_step(AGENT, good, Norms.of(good), 105, 0, guard=shrunk)
        assert scored[0] == [d.experience_id for d in shrunk]
        assert st.guard_before == pytest.approx(whole, rel=1e-5)
        assert st.guard_seconds > 0
        # a step without a guard set changes the weights unscored: the next guarded step scores its set afresh
        w.train_step(AGENT, good, Norms.of(good), 106, 0)
        scored.clear()
        w.train_step(AGENT, good, Norms.of(good), 107, 0, guard=shrunk)
        assert scored == [[d.experience_id for d in shrunk]] * 2  # before and after, not after alone
    finally:
        del w._nll_sums


def test_without_demonstrations_there_is_no_guard(worker):
    w, good, _ = worker
    st = w.train_step(AGENT, good, Norms.of(good), 102, 0)
    assert st.guard_before is None and st.guard_attempts is None and st.guard_refused is None


def _rollouts(worker: LearnerWorker) -> list[TrainItem]:
    """Four sampled answers to one question, two rewarded (GRPO's advantages +-1), with the
    logprobs their policy gave them (the ratio starts at 1, as for traffic from the newest version)."""
    tok = worker.policy.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}], add_generation_prompt=True,
                                                tokenize=False), add_special_tokens=False)
    answers = ["It is 5.", "Five.", "I do not know.", "Maybe 7?"]
    items = [TrainItem(experience_id=f"r-{k}", task_id="t", model_version=0, prompt_ids=prompt,
                       response_ids=tok.encode(text, add_special_tokens=False), old_logprobs=[], reward=float(k < 2),
                       temperature=1.0, seq=k, advantage=1.0 if k < 2 else -1.0, run_id=str(k))
             for k, text in enumerate(answers)]
    [(lp, mask)] = worker._sampled_logprobs(items)
    for row, it in enumerate(items):
        it.old_logprobs = lp[row, : int(mask[row].sum())].tolist()
    return items


@pytest.fixture(scope="module")
def kl_worker(tiny_model):
    # at lr 1e-4 a step moves this random model's policy on the samples below by about 0.007 nats per token
    # (1e-3: 0.2-0.3; 0.5: 2-2,000)
    w = LearnerWorker({"model": {"path": str(tiny_model)}, "algorithm": {"name": "grpo"}, "optim": {"lr": 1e-4},
                       "guard": {"max_kl": 0.05, "retries": 1}, "log_level": "warning"})
    w.setup()
    w.ensure_agent(AGENT)
    return w


def test_with_max_kl_an_update_that_throws_the_policy_away_is_refused_without_demonstrations(kl_worker):
    w = kl_worker
    items = _rollouts(w)
    before, opt_steps = _state(w)
    w.cfg.optim.lr = 0.5  # a huge step: the policy on its own samples moves far
    try:
        st = w.train_step(AGENT, items, Norms.of(items), 0, 0)
    finally:
        w.cfg.optim.lr = 1e-4
    assert st.guard_refused == 1.0 and st.guard_attempts == 2.0 and st.guard_before is None
    assert st.guard_kl > 0.05
    assert st.lr == pytest.approx(0.25)
    after, opt_steps_after = _state(w)
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused step changed the adapter"
    assert opt_steps_after == opt_steps
    # measured on the same samples, the weights kept give the logprobs the step started from
    [(lp, mask)] = w._sampled_logprobs(items)
    assert lp[0, : int(mask[0].sum())].tolist() == pytest.approx(items[0].old_logprobs, abs=1e-5)


def test_with_max_kl_an_ordinary_update_passes_and_reports_its_kl(kl_worker):
    w = kl_worker
    items = _rollouts(w)
    before, opt_steps = _state(w)
    st = w.train_step(AGENT, items, Norms.of(items), 1, 0)
    assert st.guard_attempts == 1.0 and st.guard_refused is None
    assert 0.0 < st.guard_kl <= 0.05
    # the KL it reports is the mean k3 from the logprobs before the update to those after, by hand
    [(lp, mask)] = w._sampled_logprobs(items)
    d = [new - old for row, it in enumerate(items) for old, new in zip(it.old_logprobs, lp[row, : int(mask[row].sum())].tolist())]
    assert st.guard_kl == pytest.approx(sum(math.exp(x) - x - 1 for x in d) / len(d), rel=1e-3)
    after, opt_steps_after = _state(w)
    assert any(not torch.equal(before[k], after[k]) for k in before) and opt_steps_after == opt_steps + 1
