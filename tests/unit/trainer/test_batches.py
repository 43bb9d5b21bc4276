"""Batch selection rules: staleness, demonstrations, GRPO groups (pure logic, no database)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from pytest import approx

from services.common.config import load_config
from services.common.records import CommittedExperience
from services.trainer.batches import select_batch
from services.trainer.config import TrainerConfig

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def select(rows, *, cfg, **kw):
    """The batch rules with the config's own objective."""
    return select_batch(rows, recipe=cfg.algorithm.recipe(), cfg=cfg, **kw)


def cfg(*overrides):
    return load_config(TrainerConfig, None, ["model.path=/m", *overrides], env={})


def row(i, *, task=None, version=0, reward=1.0, age_s=0.0, labels=None, resp=(5, 6), logprobs=None):
    return CommittedExperience(
        seq=i, experience_id=f"e{i}", agent="a", task_id=task, run_id=None, model_version=version,
        prompt_token_ids=[1, 2], response_token_ids=list(resp),
        response_logprobs=[-1.0] * len(resp) if logprobs is None else logprobs, reward=reward,
        sampling={"temperature": 0.7}, feedback={"labels": labels or []}, finish_reason="stop",
        created_at=NOW - timedelta(seconds=age_s), updated_at=NOW - timedelta(seconds=age_s),
    )


def test_ppo_takes_the_oldest_batch_and_waits_for_enough():
    c = cfg("algorithm.name=ppo", "train_batch_size=3")
    assert not select([row(1), row(2)], cfg=c, current_version=0, now=NOW).ready
    sel = select([row(i) for i in range(5)], cfg=c, current_version=0, now=NOW)
    assert [i.experience_id for i in sel.items] == ["e0", "e1", "e2"]
    assert sel.items[0].temperature == 0.7 and sel.items[0].old_logprobs == [-1.0, -1.0]


def test_stale_rows_are_discarded_or_downweighted():
    rows = [row(1, version=0), row(2, version=5), row(3, version=3)]
    c = cfg("algorithm.name=ppo", "train_batch_size=2", "staleness.max_staleness=2")
    sel = select(rows, cfg=c, current_version=5, now=NOW)
    assert "stale" in sel.discarded["e1"] and [i.experience_id for i in sel.items] == ["e2", "e3"]
    c = cfg("algorithm.name=ppo", "train_batch_size=3", "staleness.max_staleness=2", "staleness.policy=downweight",
            "staleness.downweight=0.5")
    sel = select(rows, cfg=c, current_version=5, now=NOW)
    # v0 is 5 versions behind, 3 beyond the limit: 0.5 ** 3
    assert [i.weight for i in sel.items] == [0.125, 1.0, 1.0] and sel.stale_downweighted == 1


def test_broken_rows_are_discarded():
    bad = row(1, resp=())
    sel = select([bad, row(2, reward=None)], cfg=cfg("algorithm.name=ppo"), current_version=0, now=NOW)
    assert set(sel.discarded) == {"e1", "e2"}


def test_sft_picks_demonstrations_by_reward_or_label():
    c = cfg("algorithm.name=sft", "train_batch_size=2", "algorithm.sft_min_reward=0.9")
    rows = [row(1, reward=0.2), row(2, reward=0.95), row(3, reward=0.0, labels=["demonstration"])]
    sel = select(rows, cfg=c, current_version=0, now=NOW)
    assert [i.experience_id for i in sel.items] == ["e2", "e3"] and "not labelled" in sel.discarded["e1"]


def test_grpo_takes_whole_groups_with_relative_advantages():
    c = cfg("algorithm.name=grpo", "train_batch_size=4", "algorithm.std_normalize=false")
    rows = [row(1, task="a", reward=1.0), row(2, task="a", reward=0.0), row(3, task="b", reward=0.5), row(4, task="b", reward=0.5)]
    sel = select(rows, cfg=c, current_version=0, now=NOW)
    assert [(i.experience_id, i.advantage) for i in sel.items] == [("e1", 0.5), ("e2", -0.5), ("e3", 0.0), ("e4", 0.0)]


def test_grpo_incomplete_groups_wait_then_fall_back():
    rows = [row(1, task="a"), row(2, task="a", reward=0.0), row(3, task="b", age_s=1), row(4, task="c", age_s=100)]
    # group_size 2: a is complete; b (1 member, young) waits; c is alone but old.
    c = cfg("algorithm.name=grpo", "train_batch_size=3", "algorithm.group_size=2", "algorithm.group_wait_s=60",
            "algorithm.small_groups=batch")
    sel = select(rows, cfg=c, current_version=0, now=NOW)
    assert [i.experience_id for i in sel.items] == ["e1", "e2", "e4"] and sel.small_groups == 1
    c = cfg("algorithm.name=grpo", "train_batch_size=3", "algorithm.group_size=2", "algorithm.group_wait_s=60",
            "algorithm.small_groups=discard")
    sel = select(rows, cfg=c, current_version=0, now=NOW)
    # c is dropped; a alone is not a full batch yet, so nothing trains but the discard stands
    assert not sel.ready and "min_group_size" in sel.discarded["e4"]
    c = cfg("algorithm.name=grpo", "train_batch_size=3", "algorithm.group_size=2", "algorithm.small_groups=wait")
    assert not select(rows, cfg=c, current_version=0, now=NOW).ready


def test_sft_needs_a_rule():
    with pytest.raises(Exception, match="sft needs"):
        cfg("algorithm.name=sft", "algorithm.sft_min_reward=null", "algorithm.sft_label=null")


def call(i, *, task, run, reward, seq=None, resp=(5, 6)):
    r = row(i, task=task, reward=reward, resp=resp, age_s=100)
    from dataclasses import replace

    return replace(r, run_id=run, seq=i if seq is None else seq)


def test_grpo_groups_episodes_not_calls():
    # Task t: run r1 is an episode of 5 calls (reward 1 on each: an episode reward), run r2 one call
    # (reward 0). Over episodes the mean is 0.5: r1's calls get +0.5, r2's call -0.5 (std off).
    # Counted per call, the mean would be 5/6 and r1 would weigh five times r2.
    rows = [call(i, task="t", run="r1", reward=1.0) for i in range(5)] + [call(5, task="t", run="r2", reward=0.0)]
    c = cfg("algorithm.name=grpo", "train_batch_size=6", "algorithm.std_normalize=false", "algorithm.group_size=2")
    sel = select(rows, cfg=c, current_version=0, now=NOW)
    adv = {i.experience_id: (i.advantage, i.weight) for i in sel.items}
    assert adv["e5"] == (approx(-0.5), approx(1.0))
    for k in range(5):
        assert adv[f"e{k}"] == (approx(0.5), approx(0.2))  # each episode weighs the same in total
    assert [i.experience_id for i in sel.items[:5]] == [f"e{k}" for k in range(5)]  # calls in order


def test_grpo_groups_count_the_team_episodes_an_agent_sat_out():
    # Task t: agent a acted in r1 (reward 1) and r2 (reward 0); its teammate b alone played r3 and r4
    # (team reward 0 each). The team's group is r1..r4, mean 0.25: r1 gets +0.75, r2 -0.25 (std
    # off). r5, an episode of a's already trained, is not counted again. Counting a's own episodes
    # only, the mean would be 0.5 (+0.5, -0.5) and with group_size 4 the group would still wait.
    from services.common.records import TeamEpisode

    rows = [call(0, task="t", run="r1", reward=1.0), call(1, task="t", run="r2", reward=0.0)]
    team = {"t": {"r1": TeamEpisode(1.0, frozenset({"a", "b"})), "r2": TeamEpisode(0.0, frozenset({"a", "b"})),
                  "r3": TeamEpisode(0.0, frozenset({"b"})), "r4": TeamEpisode(0.0, frozenset({"b"})),
                  "r5": TeamEpisode(1.0, frozenset({"a"}))}}
    c = cfg("algorithm.name=grpo", "train_batch_size=2", "algorithm.std_normalize=false", "algorithm.group_size=4")
    sel = select([replace_now(r) for r in rows], cfg=c, current_version=0, now=NOW, team=team)
    assert {i.experience_id: i.advantage for i in sel.items} == {"e0": approx(0.75), "e1": approx(-0.25)}
    assert sel.team_episodes == 2
    own = cfg("algorithm.name=grpo", "train_batch_size=2", "algorithm.std_normalize=false", "algorithm.group_size=4",
              "algorithm.team_credit=false")
    assert not select([replace_now(r) for r in rows], cfg=own, current_version=0, now=NOW, team=team).ready
    own = cfg("algorithm.name=grpo", "train_batch_size=2", "algorithm.std_normalize=false", "algorithm.team_credit=false")
    sel = select(rows, cfg=own, current_version=0, now=NOW, team=team)
    assert {i.experience_id: i.advantage for i in sel.items} == {"e0": approx(0.5), "e1": approx(-0.5)}


def replace_now(r):
    """The row as just updated: a group that is not complete still waits for more runs."""
    from dataclasses import replace

    return replace(r, updated_at=NOW)


def test_ppo_batches_never_split_an_episode():
    rows = [call(0, task="t", run="a", reward=1.0), call(1, task="t", run="b", reward=0.0),
            call(2, task="t", run="a", reward=1.0), call(3, task="u", run="c", reward=0.0)]
    sel = select(rows, cfg=cfg("algorithm.name=ppo", "train_batch_size=2"), current_version=0, now=NOW)
    assert sorted(i.experience_id for i in sel.items) == ["e0", "e2"]  # episode a whole; b waits for the next step


def test_demonstrations_join_each_step_and_alone_only_for_the_cold_start():
    demos = [row(100 + k) for k in range(3)]
    c = cfg("algorithm.name=grpo", "train_batch_size=4", "algorithm.cold_start_steps=2", "algorithm.demo_batch_size=2")
    sel = select([], cfg=c, current_version=0, now=NOW, demonstrations=demos, step=0)
    assert sel.ready and not sel.items and [d.experience_id for d in sel.demonstrations] == ["e100", "e101"]
    sel = select([], cfg=c, current_version=0, now=NOW, demonstrations=demos, step=1)
    assert [d.experience_id for d in sel.demonstrations] == ["e102", "e100"]  # in turn
    assert all(d.demonstration and d.old_logprobs == [] for d in sel.demonstrations)
    assert not select([], cfg=c, current_version=0, now=NOW, demonstrations=demos, step=2).ready
    off = cfg("algorithm.name=grpo", "algorithm.cold_start_steps=2", "algorithm.sft_coef=0")
    assert not select([], cfg=off, current_version=0, now=NOW, demonstrations=demos, step=0).ready


def test_the_guard_set_is_the_same_first_demonstrations_every_step():
    demos = [row(100 + k) for k in range(3)]
    c = cfg("algorithm.name=grpo", "algorithm.cold_start_steps=2", "algorithm.demo_batch_size=1", "guard.demonstrations=2")
    for step in (0, 1):
        sel = select([], cfg=c, current_version=0, now=NOW, demonstrations=demos, step=step)
        assert [d.experience_id for d in sel.guard] == ["e100", "e101"]
    off = cfg("algorithm.name=grpo", "algorithm.cold_start_steps=2", "guard.demonstrations=0")
    assert select([], cfg=off, current_version=0, now=NOW, demonstrations=demos, step=0).guard == []
    assert select([], cfg=c, current_version=0, now=NOW, step=0).guard == []  # no demonstrations, no guard


def test_the_guard_leaves_users_corrections_out_unless_asked():
    hand = ["demonstration"]
    corrected = ["demonstration", "correction"]
    demos = [row(100, labels=hand), row(101, labels=corrected), row(102, labels=hand), row(103, labels=corrected)]
    c = cfg("algorithm.name=grpo", "algorithm.cold_start_steps=2", "guard.demonstrations=3")
    assert [d.experience_id for d in select([], cfg=c, current_version=0, now=NOW, demonstrations=demos, step=0).guard] \
        == ["e100", "e102"]
    both = cfg("algorithm.name=grpo", "algorithm.cold_start_steps=2", "guard.demonstrations=3", "guard.corrections=true")
    assert [d.experience_id for d in select([], cfg=both, current_version=0, now=NOW, demonstrations=demos, step=0).guard] \
        == ["e100", "e101", "e102"]
    # corrections alone: no guard set (nothing hand-written to keep)
    assert select([], cfg=c, current_version=0, now=NOW, demonstrations=demos[1::2], step=0).guard == []


def test_catch_up_sizes_steps_so_a_backlog_is_trained_before_it_goes_stale():
    from services.trainer.batches import catch_up_size

    c = cfg("train_batch_size=16", "staleness.max_staleness=4", "save_interval=1")
    # The case: 800 rows of v0, Trainer at v0. Each has 4 - 0 + 1 = 5 steps left: 800 / 5 = 160.
    assert catch_up_size([row(i) for i in range(800)], cfg=c, current_version=0, step=0) == 160
    # No backlog: the plain batch.
    assert catch_up_size([row(i) for i in range(20)], cfg=c, current_version=0, step=0) == 16
    # 30 rows of v0 at v4 (1 step left) and 40 of v4 (5 steps): k=1 needs 30, k=5 needs ceil(70/5)=14: 30.
    rows = [row(i, version=0) for i in range(30)] + [row(30 + i, version=4) for i in range(40)]
    assert catch_up_size(rows, cfg=c, current_version=4, step=9) == 30
    # Rows already stale or without a reward count for nothing.
    rows = [row(i, version=0) for i in range(50)] + [row(50 + i, reward=None, version=4) for i in range(50)]
    assert catch_up_size(rows, cfg=c, current_version=5, step=9) == 16
    # save_interval 2, max_staleness 1, at step 3 (1 step until the next publication): v0 rows at v0
    # have 1 + 1 * 2 = 3 steps left: 90 / 3 = 30.
    c2 = cfg("train_batch_size=8", "staleness.max_staleness=1", "save_interval=2")
    assert catch_up_size([row(i) for i in range(90)], cfg=c2, current_version=0, step=3) == 30
    # Capped, and off with 0.
    assert catch_up_size([row(i) for i in range(800)], cfg=cfg("staleness.catch_up_max_rows=100"), current_version=0,
                         step=0) == 100
    assert catch_up_size([row(i) for i in range(800)], cfg=cfg("staleness.catch_up_max_rows=0"), current_version=0,
                         step=0) == 16


def test_a_catch_up_batch_is_taken_oldest_first():
    c = cfg("algorithm.name=ppo", "train_batch_size=40")
    sel = select([row(i) for i in range(100)], cfg=c, current_version=0, now=NOW)
    assert [i.experience_id for i in sel.items] == [f"e{i}" for i in range(40)]


def test_length_chunks_cap_rows_and_padded_tokens():
    from services.trainer.batches import TrainItem, length_chunks

    def it(seq, prompt, response):
        return TrainItem(experience_id=f"e{seq}", task_id=None, model_version=0, prompt_ids=[1] * prompt,
                         response_ids=[2] * response, old_logprobs=[], reward=1.0, temperature=1.0, seq=seq)

    # lengths (prompt + response): e0 2+8=10, e1 4+1=5, e2 3+3=6, e3 10+10=20, e4 1+2=3
    items = [it(0, 2, 8), it(1, 4, 1), it(2, 3, 3), it(3, 10, 10), it(4, 1, 2)]
    ids = lambda chunks: [[i.experience_id for i in c] for c in chunks]  # noqa: E731
    assert ids(length_chunks(items, 2)) == [["e4", "e1"], ["e2", "e0"], ["e3"]]  # shortest first, 2 rows each
    # padded positions = rows x (longest prompt + longest response): e4+e1 = 2 x (4 + 2) = 12; + e2 = 3 x (4 + 3)
    # = 21 > 18; e2+e0 = 2 x (3 + 8) = 22 > 18; e0 alone 10; e3 (20) is longer than the budget: alone
    assert ids(length_chunks(items, 8, tokens=18)) == [["e4", "e1"], ["e2"], ["e0"], ["e3"]]
    assert ids(length_chunks(items, 8, tokens=21)) == [["e4", "e1", "e2"], ["e0"], ["e3"]]
    assert length_chunks([], 4, tokens=10) == []
