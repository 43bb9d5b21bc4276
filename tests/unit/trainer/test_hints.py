"""Hints as training signal (services/trainer/recipes/opd.py, hints.py, grpo's hint_coef): which rows
the recipes take, the teacher's inputs lined up with the batch, and the loss's gradient worked by hand."""

from __future__ import annotations

import math
from datetime import datetime, timezone

import pytest
import torch
from pytest import approx

from services.common.config import ConfigError, load_config
from services.common.records import CommittedExperience
from services.trainer.batches import Norms, select_batch
from services.trainer.config import TrainerConfig
from services.trainer.recipes.base import MicroBatch
from services.trainer.recipes.hints import hint_figures, teacher_inputs

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def cfg(*overrides: str) -> TrainerConfig:
    return load_config(TrainerConfig, None, ["model.path=/m", *overrides], env={})


def row(i: int, *, reward: float | None = None, hint: bool = True) -> CommittedExperience:
    return CommittedExperience(
        experience_id=f"e{i}", agent="a", task_id=f"t{i}", run_id=None, seq=i, model_version=0,
        prompt_token_ids=[1, 2], response_token_ids=[3, 4], response_logprobs=[-0.5, -0.5], reward=reward,
        sampling={"temperature": 0.7}, feedback=None, finish_reason="stop", created_at=NOW, updated_at=NOW,
        hint={"text": "use the tool", "prompt_token_ids": [1, 2, 9, 9]} if hint else None,
    )


class FixedScorer:
    """Hands back given logprobs, and keeps what it was asked (a fake: the math is under test)."""

    def __init__(self, lp: torch.Tensor):
        self.lp, self.asked = lp, []

    def logprobs(self, prompts, responses, temperatures, *, adapter=True, model=None, version=None):
        self.asked.append((prompts, responses, temperatures, adapter) + ((model,) if model else ()))
        return self.lp

    def top_logprobs(self, prompts, responses, temperatures, k, *, adapter=True, model=None, version=None):
        self.asked.append((prompts, responses, temperatures, adapter, k))
        top = torch.log(torch.tensor([[[0.6, 0.2], [0.5, 0.4]]]))
        return self.lp, top[..., :k], torch.tensor([[[7, 8], [9, 3]]])[..., :k]

    def has_version(self, version):
        return True


class VersionScorer:
    """Scores every token of a row at minus the version it was asked under (0: as the adapter stands), and
    keeps the versions asked; ``published`` are the versions it can read (a fake: the grouping is under test)."""

    def __init__(self, published: set[int]):
        self.published, self.asked = published, []

    def has_version(self, version):
        return version in self.published

    def logprobs(self, prompts, responses, temperatures, *, adapter=True, model=None, version=None):
        self.asked.append((version, len(prompts), adapter))
        v = version if version in self.published else 0
        return torch.full((len(prompts), max(map(len, responses))), -float(v))


def test_opd_takes_hinted_rows_without_a_reward_and_sets_the_others_aside():
    c = cfg("algorithm.name=opd", "train_batch_size=1")
    sel = select_batch([row(1), row(2, reward=1.0, hint=False)], recipe=c.algorithm.recipe(), cfg=c, current_version=0,
                       now=NOW)
    assert [i.experience_id for i in sel.items] == ["e1"] and sel.items[0].teacher_prompt_ids == [1, 2, 9, 9]
    assert sel.discarded["e2"].startswith("no hint")
    with pytest.raises(ConfigError, match="algorithm.level must be token"):
        cfg("algorithm.name=grpo", "algorithm.grpo.hint_coef=1", "algorithm.level=sequence")


def test_the_teachers_logprobs_line_up_with_the_batch_and_unhinted_rows_get_none():
    c = cfg("algorithm.name=opd", "train_batch_size=1", "algorithm.opd.top_k=0")
    sel = select_batch([row(1)], recipe=c.algorithm.recipe(), cfg=c, current_version=0, now=NOW)
    plain = sel.items[0].__class__(**{**sel.items[0].__dict__, "experience_id": "e2", "teacher_prompt_ids": None,
                                      "response_ids": [5, 6, 7]})
    scorer = FixedScorer(torch.tensor([[-0.1, -0.2]]))
    x = teacher_inputs([sel.items[0], plain], scorer, "base")
    assert scorer.asked == [([[1, 2, 9, 9]], [[3, 4]], [0.7], False)]  # the hinted row alone, at its temperature
    assert x["teacher"].tolist() == [[approx(-0.1), approx(-0.2), 0.0], [0.0, 0.0, 0.0]]
    assert x["hinted"].tolist() == [1.0, 0.0] and x["teacher_s"].item() >= 0
    other = FixedScorer(torch.tensor([[-0.1, -0.2]]))  # a teacher of its own, by path
    teacher_inputs([sel.items[0]], other, "/models/teacher")
    assert other.asked == [([[1, 2, 9, 9]], [[3, 4]], [0.7], False, "/models/teacher")]


def _micro(recipe, items, logprobs, teacher, advantages=None):
    mask = torch.ones_like(logprobs)
    if advantages is not None:
        for it, a in zip(items, advantages):
            it.advantage = a
    return MicroBatch(
        items=items, logprobs=logprobs, old_logprobs=torch.full_like(logprobs, -0.5), mask=mask,
        weights=torch.ones(len(items)), rewards=torch.zeros(len(items)), hidden=None, value_head=None,
        norms=Norms(tokens=float(mask.sum()), sequences=float(len(items))), objective=recipe.objective,
        sequence_level=False, key=0, first_epoch=True,
        extra={"teacher": teacher, "hinted": torch.ones(len(items)), "teacher_s": torch.tensor(0.25)},
    )


def test_opd_pushes_up_the_tokens_the_teacher_prefers_and_down_the_others():
    c = cfg("algorithm.name=opd", "train_batch_size=1", "algorithm.opd.top_k=0")  # the sampled tokens' term alone
    recipe = c.algorithm.recipe()
    sel = select_batch([row(1)], recipe=recipe, cfg=c, current_version=0, now=NOW)
    # sampled at -0.5 each; the teacher finds token 1 likelier (-0.1: +0.4) and token 2 less likely (-1.5: -1.0)
    lp = torch.full((1, 2), -0.5, requires_grad=True)
    mb = _micro(recipe, sel.items, lp, torch.tensor([[-0.1, -1.5]]))
    loss, stats = recipe.loss(mb)
    loss.backward()
    # at ratio 1 the loss is -mean(r * A): d/dlp_t = -A_t / 2 tokens
    assert lp.grad.tolist() == [[approx(-0.2), approx(0.5)]]
    figures = hint_figures({k: float(v) for k, v in stats.items()})
    assert figures["hinted_share"] == approx(1.0) and figures["distill_advantage"] == approx(-0.3)
    assert figures["teacher_s"] == approx(0.25)


def test_a_baseline_per_call_centres_what_is_trained_and_the_figures_keep_the_reverse_kl():
    c = cfg("algorithm.name=opd", "train_batch_size=1", "algorithm.opd.top_k=0", "algorithm.opd.hint_baseline=call")
    recipe = c.algorithm.recipe()
    sel = select_batch([row(1)], recipe=recipe, cfg=c, current_version=0, now=NOW)
    lp = torch.full((1, 2), -0.5, requires_grad=True)
    mb = _micro(recipe, sel.items, lp, torch.tensor([[-0.1, -1.5]]))  # gaps +0.4, -1.0: mean -0.3
    loss, stats = recipe.loss(mb)
    loss.backward()
    assert lp.grad.tolist() == [[approx(-0.35), approx(0.35)]]  # A = (+0.7, -0.7), over 2 tokens
    assert hint_figures({k: float(v) for k, v in stats.items()})["distill_advantage"] == approx(-0.3)
    with pytest.raises(ConfigError, match="hint_baseline"):
        cfg("algorithm.name=opd", "algorithm.opd.hint_baseline=batch")


def test_grpo_adds_the_hints_advantage_to_the_rewards_on_hinted_calls_only():
    c = cfg("algorithm.name=grpo", "train_batch_size=1", "algorithm.grpo.hint_coef=0.5", "algorithm.level=token",
            "algorithm.grpo.min_group_size=1", "algorithm.grpo.top_k=0")
    recipe = c.algorithm.recipe()
    sel = select_batch([row(1, reward=1.0)], recipe=recipe, cfg=c, current_version=0, now=NOW)
    items = sel.items + [sel.items[0].__class__(**{**sel.items[0].__dict__, "teacher_prompt_ids": None})]
    lp = torch.full((2, 2), -0.5, requires_grad=True)
    mb = _micro(recipe, items, lp, torch.tensor([[-0.1, -1.5], [0.0, 0.0]]), advantages=[1.0, 1.0])
    mb.extra["hinted"] = torch.tensor([1.0, 0.0])
    loss, _ = recipe.loss(mb)
    loss.backward()
    # A = 1 + 0.5 * (+0.4, -1.0) on the hinted call, 1 on the other; 4 tokens: grad = -A / 4
    assert lp.grad.tolist() == [[approx(-1.2 / 4), approx(-0.5 / 4)], [approx(-0.25), approx(-0.25)]]
    assert math.isclose(recipe.statistics({"hinted_share": 0.5, "distill_sum_share": -0.15}, tokens=4)["distill_advantage"],
                        -0.3)


def test_with_top_k_the_teachers_likeliest_tokens_are_asked_of_the_learners_forward_and_pulled_up():
    from services.trainer.recipes.base import GATHER_IDS

    c = cfg("algorithm.name=opd", "train_batch_size=1", "algorithm.opd.top_k=2", "algorithm.opd.top_k_coef=2")
    recipe = c.algorithm.recipe()
    sel = select_batch([row(1)], recipe=recipe, cfg=c, current_version=0, now=NOW)
    plain = sel.items[0].__class__(**{**sel.items[0].__dict__, "teacher_prompt_ids": None})
    x = recipe.extra_inputs([sel.items[0], plain], FixedScorer(torch.tensor([[-0.1, -0.2]])))
    assert x[GATHER_IDS].tolist() == [[[7, 8], [9, 3]], [[0, 0], [0, 0]]] and x["teacher_top"].shape == (2, 2, 2)
    # the student's logprobs of those ids, as the learner's forward gathers them: 0.3/0.3 and 0.5/0.4
    gathered = torch.log(torch.tensor([[[0.3, 0.3], [0.5, 0.4]], [[0.1, 0.1], [0.1, 0.1]]])).requires_grad_()
    lp = torch.full((2, 2), -0.5, requires_grad=True)
    mb = _micro(recipe, [sel.items[0], plain], lp, x["teacher"])
    mb.extra.update(x)
    mb.gathered = gathered
    loss, stats = recipe.loss(mb)
    loss.backward()
    # teacher 0.6, 0.2 (rest 0.2) at position 0, 0.5, 0.4 (rest 0.1) at 1; student 0.3, 0.3 (rest 0.4) and 0.5, 0.4
    # (rest 0.1): d/d log s_v = -t_v + t_rest * s_v / s_rest, times coef 2 over 4 tokens
    g0 = [(-0.6 + 0.2 * 0.3 / 0.4) / 2, (-0.2 + 0.2 * 0.3 / 0.4) / 2]
    assert gathered.grad[0].tolist() == [[approx(g0[0]), approx(g0[1])], [approx(0.0, abs=1e-6), approx(0.0, abs=1e-6)]]
    assert gathered.grad[1].abs().sum().item() == 0  # no hint: no teacher
    kl0 = 0.6 * math.log(0.6 / 0.3) + 0.2 * math.log(0.2 / 0.3) + 0.2 * math.log(0.2 / 0.4)
    kl1 = 0.0  # the student already matches the teacher there
    figures = hint_figures({k: float(v) for k, v in stats.items()})
    assert figures["teacher_kl"] == approx((kl0 + kl1) / 2) and figures["hinted_share"] == approx(0.5)


def test_calls_sampled_under_a_grammar_get_the_sampled_term_only_and_a_hint_alone_is_named_when_set_aside():
    from services.trainer.recipes.base import GATHER_IDS

    c = cfg("algorithm.name=opd", "train_batch_size=1", "algorithm.opd.top_k=2")
    sel = select_batch([row(1)], recipe=c.algorithm.recipe(), cfg=c, current_version=0, now=NOW)
    constrained = sel.items[0].__class__(**{**sel.items[0].__dict__, "grammar": 'root ::= "x"'})
    x = c.algorithm.recipe().extra_inputs([constrained], FixedScorer(torch.tensor([[-0.1, -0.2]])))
    assert GATHER_IDS not in x and x["hinted"].tolist() == [1.0]  # the top-k term: none; the sampled one: yes
    g = cfg("algorithm.name=grpo", "train_batch_size=1")
    sel = select_batch([row(2, reward=None)], recipe=g.algorithm.recipe(), cfg=g, current_version=0, now=NOW)
    assert sel.discarded["e2"] == "no reward, a hint alone (algorithm opd learns from those)"


def test_skipping_the_first_token_leaves_the_call_or_words_choice_to_the_reward():
    """hint_skip_first=1: the teacher's gap on a hinted call's first token (the one that opens a tool call
    or starts an answer in words) is not trained, in grpo (the reward's advantage stays on it) and in the
    top-k term; the tokens after it are trained as before."""
    from services.trainer.recipes.base import GATHER_IDS

    c = cfg("algorithm.name=grpo", "train_batch_size=1", "algorithm.grpo.hint_coef=0.5", "algorithm.level=token",
            "algorithm.grpo.min_group_size=1", "algorithm.grpo.top_k=2", "algorithm.grpo.hint_skip_first=1")
    recipe = c.algorithm.recipe()
    sel = select_batch([row(1, reward=1.0)], recipe=recipe, cfg=c, current_version=0, now=NOW)
    x = recipe.extra_inputs(sel.items, FixedScorer(torch.tensor([[-0.1, -1.5]])))
    lp = torch.full((1, 2), -0.5, requires_grad=True)
    mb = _micro(recipe, sel.items, lp, x["teacher"], advantages=[1.0])
    mb.extra.update(x)
    gathered = torch.log(torch.tensor([[[0.3, 0.3], [0.5, 0.4]]])).requires_grad_()
    mb.gathered = gathered
    loss, stats = recipe.loss(mb)
    loss.backward()
    # A = 1 on the first token (its +0.4 gap skipped), 1 + 0.5 * (-1.0) = 0.5 on the second; 2 tokens: grad = -A / 2
    assert lp.grad.tolist() == [[approx(-0.5), approx(-0.25)]]
    # the top-k term: nothing at the first position; at the second the student (0.5, 0.4) already matches the teacher
    assert gathered.grad[0, 0].abs().sum().item() == 0
    figures = hint_figures({k: float(v) for k, v in stats.items()})
    assert figures["hinted_share"] == approx(0.5) and figures["distill_advantage"] == approx(-1.0)
    with pytest.raises(ConfigError, match="hint_skip_first"):
        cfg("algorithm.name=grpo", "algorithm.grpo.hint_skip_first=-1")
    assert GATHER_IDS in x


def test_the_policy_as_teacher_scores_each_call_under_the_version_that_sampled_it():
    c = cfg("algorithm.name=opd", "train_batch_size=3")
    sel = select_batch([row(1), row(2), row(3)], recipe=c.algorithm.recipe(), cfg=c, current_version=0, now=NOW)
    a, b, old = (sel.items[0].__class__(**{**it.__dict__, "model_version": v}) for it, v in zip(sel.items, (5, 4, 2)))
    scorer = VersionScorer(published={4, 5})
    x = teacher_inputs([a, b, old, sel.items[0].__class__(**{**a.__dict__, "teacher_prompt_ids": None})], scorer, "policy")
    # one forward per version, each call's tokens under its own; v2 cannot be read: scored as the adapter stands
    assert sorted(scorer.asked) == [(2, 1, True), (4, 1, True), (5, 1, True)]
    assert x["teacher"][:, 0].tolist() == [-5.0, -4.0, 0.0, 0.0] and x["teacher_unmatched"].item() == 1.0
    scorer = VersionScorer(published={4, 5})
    teacher_inputs([a, b], scorer, "base")  # the base model has no versions: one forward, no version asked
    assert scorer.asked == [(None, 2, False)]
