"""The levers that make the agent's own traffic pay, each worked by hand: the supervised term's
schedule (demonstrations decaying, replayed successes growing), the successes pool, GRPO's flat
groups (discarded or against a baseline), demonstrations only where groups failed, response-level
aggregation and importance correction in the GRPO loss."""

from __future__ import annotations

from datetime import datetime, timezone

import torch
from pytest import approx

from services.common.config import load_config
from services.common.records import CommittedExperience
from services.trainer.batches import (
    Norms,
    demonstration_weight,
    imitation_pool,
    imitation_weight,
    select_batch,
    to_item,
)
from services.trainer.config import TrainerConfig
from services.trainer.recipes import MicroBatch

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def cfg(*overrides: str) -> TrainerConfig:
    return load_config(TrainerConfig, None, ["model.path=/m", *overrides], env={})


def row(i: int, task: str, run: str, reward: float, response=(3,), seq: int | None = None) -> CommittedExperience:
    return CommittedExperience(
        experience_id=f"e{i}", agent="a", task_id=task, run_id=run, seq=i if seq is None else seq, model_version=0,
        prompt_token_ids=[1, 2], response_token_ids=list(response), response_logprobs=[-0.5] * len(response),
        reward=reward, sampling={}, feedback=None, finish_reason="stop", created_at=NOW, updated_at=NOW,
    )


def test_the_supervised_terms_schedule():
    o = cfg("algorithm.sft_coef=1", "algorithm.sft_coef_final=0.2", "algorithm.sft_decay_steps=4",
            "algorithm.cold_start_steps=4", "algorithm.self_imitation.coef=1", "algorithm.self_imitation.ramp_steps=4").algorithm
    # demonstrations: 1.0 through the cold start, then down by 0.2 a step to 0.2
    assert [demonstration_weight(o, s) for s in (0, 4, 5, 6, 8, 20)] == [1.0, 1.0, approx(0.8), approx(0.6), approx(0.2), approx(0.2)]
    # successes: none during the cold start, then up by 0.25 a step to 1
    assert [imitation_weight(o, s) for s in (0, 3, 4, 5, 7, 20)] == [0.0, 0.0, 0.25, 0.5, 1.0, 1.0]
    plain = cfg().algorithm
    assert demonstration_weight(plain, 7) == 1.0 and imitation_weight(plain, 7) == 0.0


def test_the_successes_pool_keeps_the_best_distinct_episodes_of_each_task():
    rows = [
        row(1, "t1", "0", 1.0, (5,)), row(2, "t1", "0", 1.0, (6,)),  # t1 run 0: two calls
        row(3, "t1", "1", 1.0, (5,)), row(4, "t1", "1", 1.0, (6,)),  # the same two answers again: a duplicate
        row(5, "t1", "2", 2.0, (7,)),  # the best of t1
        row(6, "t2", "0", 1.0, (5,)),
        row(7, "t2", "1", 1.0, (8,)),  # t2: the newer of two equal ones first
        row(8, "t3", "0", 1.0, ()),  # no tokens (redacted): never replayed
    ]
    assert [r.experience_id for r in imitation_pool(rows, per_task=1)] == ["e5", "e7"]
    # two per task: t1's best, then the newest of its two equal runs (the older repeats it); both calls of it
    assert [r.experience_id for r in imitation_pool(rows, per_task=2)] == ["e3", "e4", "e5", "e6", "e7"]


def _groups(*rewards_by_task: tuple[float, ...]) -> list[CommittedExperience]:
    rows, i = [], 0
    for t, rewards in enumerate(rewards_by_task):
        for run, r in enumerate(rewards):
            rows.append(row(i, f"t{t}", str(run), r))
            i += 1
    return rows


def test_flat_groups_are_set_aside_and_the_step_filled_with_groups_that_carry_signal():
    c = cfg("algorithm.name=grpo", "train_batch_size=4", "algorithm.grpo.group_size=2", "algorithm.grpo.flat_groups=discard",
            "algorithm.grpo.std_normalize=false")
    rows = _groups((0.0, 0.0), (1.0, 1.0), (1.0, 0.0), (0.0, 1.0))
    sel = select_batch(rows, recipe=c.algorithm.recipe(), cfg=c, current_version=0, now=NOW)
    assert [i.task_id for i in sel.items] == ["t2", "t2", "t3", "t3"]
    assert [i.advantage for i in sel.items] == [0.5, -0.5, -0.5, 0.5]
    assert sel.discarded == {"e0": "no signal: every episode of the group scored 0", "e1": "no signal: every episode of the group scored 0",
                             "e2": "no signal: every episode of the group scored 1", "e3": "no signal: every episode of the group scored 1"}
    assert sel.figures == {"informative_groups": 2.0, "flat_groups": 2.0, "informative_share": 0.5, "flat_set_aside": 2.0}
    assert (sel.groups, sel.failed_groups) == (4, 1)  # t0: no success
    # keep (the default): the flat groups are trained, at advantage 0
    k = cfg("algorithm.name=grpo", "train_batch_size=4", "algorithm.grpo.group_size=2")
    sel = select_batch(rows, recipe=k.algorithm.recipe(), cfg=k, current_version=0, now=NOW)
    assert [i.task_id for i in sel.items] == ["t0", "t0", "t1", "t1"] and {i.advantage for i in sel.items} == {0.0}


def test_flat_groups_set_aside_are_counted_across_polls_and_bounded():
    c = cfg("algorithm.name=grpo", "train_batch_size=4", "algorithm.grpo.group_size=2", "algorithm.grpo.flat_groups=discard",
            "algorithm.grpo.std_normalize=false")
    recipe = c.algorithm.recipe()
    # a poll of two flat groups and one with signal: no step; the two are set aside and counted
    first = select_batch(_groups((0.0, 0.0), (0.0, 0.0), (1.0, 0.0)), recipe=recipe, cfg=c, current_version=0, now=NOW)
    assert not first.ready and len(first.discarded) == 4 and first.flat_set_aside == 2
    # the next poll (the group with signal again, then a flat one and one more with signal), told of the two set aside:
    # the step's figures count the earlier polls' flat groups too
    rows = [r for r in _groups((0.0, 0.0), (0.0, 0.0), (1.0, 0.0), (1.0, 1.0), (0.0, 1.0)) if r.task_id != "t0" and r.task_id != "t1"]
    sel = select_batch(rows, recipe=recipe, cfg=c, current_version=0, now=NOW, set_aside=first.flat_set_aside)
    assert [i.task_id for i in sel.items] == ["t2", "t2", "t4", "t4"] and sel.flat_set_aside == 3
    assert sel.figures == {"informative_groups": 2.0, "flat_groups": 3.0, "informative_share": 0.4, "flat_set_aside": 3.0}
    # flat_max_set_aside 3: two set aside before, so the third is set aside, and the fourth and later are kept (advantage
    # 0), after every group with signal: t3 first, then t1 fills the batch; t2 is left for the next poll
    b = cfg("algorithm.name=grpo", "train_batch_size=4", "algorithm.grpo.group_size=2", "algorithm.grpo.flat_groups=discard",
            "algorithm.grpo.flat_max_set_aside=3", "algorithm.grpo.std_normalize=false")
    rows = _groups((1.0, 1.0), (0.0, 0.0), (0.0, 0.0), (1.0, 0.0))
    sel = select_batch(rows, recipe=b.algorithm.recipe(), cfg=b, current_version=0, now=NOW, set_aside=2)
    assert set(sel.discarded) == {"e0", "e1"} and sel.flat_set_aside == 3
    assert [(i.task_id, i.advantage) for i in sel.items] == [("t3", 0.5), ("t3", -0.5), ("t1", 0.0), ("t1", 0.0)]
    assert sel.figures == {"informative_groups": 1.0, "flat_groups": 4.0, "informative_share": 0.2, "flat_set_aside": 3.0}
    assert (sel.groups, sel.failed_groups) == (3, 1)  # this poll's: t0 (all right) set aside, t3 and t1 (all wrong) trained
    # with only flat groups past the bound, they fill the step by themselves
    sel = select_batch(_groups((0.0, 0.0), (1.0, 1.0), (0.0, 0.0)), recipe=b.algorithm.recipe(), cfg=b, current_version=0,
                       now=NOW, set_aside=3)
    assert not sel.discarded and [i.task_id for i in sel.items] == ["t0", "t0", "t1", "t1"]
    assert {i.advantage for i in sel.items} == {0.0} and sel.figures["informative_share"] == 0.0
    # unbounded, the same poll waits for signal: all three flat groups set aside, no step
    sel = select_batch(rows, recipe=recipe, cfg=c, current_version=0, now=NOW, set_aside=2)
    assert not sel.ready and len(sel.discarded) == 6 and sel.flat_set_aside == 5


def test_flat_groups_against_a_fixed_baseline_still_teach():
    c = cfg("algorithm.name=grpo", "train_batch_size=6", "algorithm.grpo.group_size=2", "algorithm.grpo.flat_groups=baseline",
            "algorithm.grpo.flat_baseline=0.25", "algorithm.grpo.std_normalize=false")
    sel = select_batch(_groups((0.0, 0.0), (1.0, 1.0), (1.0, 0.0)), recipe=c.algorithm.recipe(), cfg=c, current_version=0, now=NOW)
    # all wrong: 0 - 0.25; all right: 1 - 0.25; the mixed group as usual (mean 0.5)
    assert [i.advantage for i in sel.items] == [-0.25, -0.25, 0.75, 0.75, 0.5, -0.5]


def test_demonstrations_replayed_in_proportion_to_the_groups_that_failed():
    demos = [row(100 + k, "demo", str(k), 0.0) for k in range(8)]
    base = ("algorithm.name=grpo", "train_batch_size=4", "algorithm.grpo.group_size=2", "algorithm.demo_batch_size=4")
    c = cfg(*base, "algorithm.demo_replay=failed_groups")
    one_failed = _groups((0.0, 0.0), (1.0, 0.0))
    sel = select_batch(one_failed, recipe=c.algorithm.recipe(), cfg=c, current_version=0, now=NOW, demonstrations=demos, step=9)
    assert len(sel.demonstrations) == 2  # 4 x 1/2 groups failed
    sel = select_batch(_groups((1.0, 0.0), (1.0, 1.0)), recipe=c.algorithm.recipe(), cfg=c, current_version=0, now=NOW,
                       demonstrations=demos, step=9)
    assert sel.items and sel.demonstrations == []  # every group found a success
    every = cfg(*base)
    sel = select_batch(one_failed, recipe=every.algorithm.recipe(), cfg=every, current_version=0, now=NOW,
                       demonstrations=demos, step=9)
    assert len(sel.demonstrations) == 4


def test_successes_join_the_supervised_term_at_their_weight():
    c = cfg("algorithm.name=grpo", "train_batch_size=2", "algorithm.grpo.group_size=2", "algorithm.self_imitation.coef=0.5",
            "algorithm.self_imitation.batch_size=2", "algorithm.sft_coef=0")
    successes = [row(50, "old", "0", 1.0, (9,)), row(51, "old", "1", 1.0, (9,)), row(52, "older", "0", 1.0, (7,))]
    sel = select_batch(_groups((1.0, 0.0)), recipe=c.algorithm.recipe(), cfg=c, current_version=0, now=NOW,
                       successes=successes, step=3)
    assert [(i.experience_id, i.weight, i.demonstration) for i in sel.imitations] == [("e51", 0.5, True), ("e52", 0.5, True)]
    assert Norms.of(sel.all_items).demo_tokens == 2.0


def _micro(c: TrainerConfig, logprobs: list[list[float]], old: list[list[float]], mask: list[list[float]],
           advantages: list[float], first: bool = True, cache: dict | None = None):
    items = [to_item(row(k, "t", str(k), 0.0, tuple(range(len(m)))), 1.0) for k, m in enumerate(mask)]
    for it, a in zip(items, advantages):
        it.advantage = a
    m = torch.tensor(mask)
    lp = torch.tensor(logprobs, requires_grad=True)
    return lp, MicroBatch(items=items, logprobs=lp, old_logprobs=torch.tensor(old), mask=m, weights=torch.ones(len(items)),
                          rewards=torch.zeros(len(items)), hidden=None, value_head=None,
                          norms=Norms(tokens=float(m.sum()), sequences=float(len(items))), objective=c.algorithm,
                          sequence_level=False, key=0, first_epoch=first, cache={} if cache is None else cache)


def test_grpo_response_level_aggregation_by_hand():
    c = cfg("algorithm.name=grpo", "algorithm.grpo.aggregation=sequence")
    # at ratio 1 the token loss is -A: response 1 (3 tokens, A=1) and response 2 (1 token, A=-1)
    # token mean: (-3 + 1) / 4 = -0.5; response mean: (-1 + 1) / 2 = 0
    _, mb = _micro(c, [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]],
                   [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], [1.0, -1.0])
    loss, _ = c.algorithm.recipe().loss(mb)
    assert loss.item() == approx(0.0)
    t = cfg("algorithm.name=grpo")
    _, mb = _micro(t, [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]],
                   [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], [1.0, -1.0])
    assert t.algorithm.recipe().loss(mb)[0].item() == approx(-0.5)


def test_grpo_importance_correction_by_hand():
    import math

    c = cfg("algorithm.name=grpo", "algorithm.grpo.importance=truncate", "algorithm.grpo.importance_cap=2")
    recipe = c.algorithm.recipe()
    # the Trainer's policy now: logprobs 0 and 0; the engine recorded ln(1/4) and 0 (the first token 4x less likely
    # there): weights 4 -> truncated to 2, and 1. First epoch: the ratio is against the proximal policy, so 1.
    # loss = -(2 * 1 * A + 1 * 1 * A) / 2 with A = 1 -> -1.5
    cache: dict = {}
    _, mb = _micro(c, [[0.0, 0.0]], [[math.log(0.25), 0.0]], [[1.0, 1.0]], [1.0], cache=cache)
    loss, st = recipe.loss(mb)
    assert loss.item() == approx(-1.5)
    assert st["is_weight_mean"].item() == approx(1.5) and st["is_capped_frac"].item() == approx(0.5)
    assert st["clip_frac"].item() == 0.0
    # a later epoch: the policy moved to ln(1.5) on both tokens; the ratio 1.5 is clipped at 1.2 (A > 0):
    # loss = -(2 * 1.2 + 1 * 1.2) / 2 = -1.8
    _, mb = _micro(c, [[math.log(1.5), math.log(1.5)]], [[math.log(0.25), 0.0]], [[1.0, 1.0]], [1.0], first=False, cache=cache)
    assert recipe.loss(mb)[0].item() == approx(-1.8)
    # off: the ratio against the recorded logprobs, 4 on the first token, clipped to 1.2: -(1.2 + 1) / 2
    off = cfg("algorithm.name=grpo")
    _, mb = _micro(off, [[0.0, 0.0]], [[math.log(0.25), 0.0]], [[1.0, 1.0]], [1.0])
    assert off.algorithm.recipe().loss(mb)[0].item() == approx(-1.1)
