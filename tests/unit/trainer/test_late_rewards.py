"""late_rewards: retrain (services/trainer/recipes/grpo.py late_items and its loss), worked by hand."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
import torch
from pytest import approx

from services.common.config import ConfigError, load_config
from services.common.records import CommittedExperience, TeamEpisode
from services.trainer.batches import Norms
from services.trainer.config import TrainerConfig
from services.trainer.recipes.base import MicroBatch

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def cfg(*overrides: str) -> TrainerConfig:
    return load_config(TrainerConfig, None, ["model.path=/m", "algorithm.name=grpo", "algorithm.level=token", *overrides],
                       env={})


def row(i: int, task: str, run: str, reward: float) -> CommittedExperience:
    return CommittedExperience(
        experience_id=f"e{i}", agent="a", task_id=task, run_id=run, seq=i, model_version=1,
        prompt_token_ids=[1, 2], response_token_ids=[3, 4], response_logprobs=[-1.0, -1.0], reward=reward,
        sampling={}, feedback=None, finish_reason="stop", created_at=NOW, updated_at=NOW,
    )


def team(**rewards: float) -> dict:
    return {run: TeamEpisode(reward=r, agents=frozenset({"a"})) for run, r in rewards.items()}


def test_a_late_episode_is_valued_against_its_group_as_the_rewards_stand_now():
    recipe = cfg("algorithm.grpo.std_normalize=false").algorithm.recipe()
    # task t: runs 0, 1, 2 now scored 1, 0, 0 (run 0's reward came late, was 0); run 0 has two calls
    rows = [row(1, "t", "0", 1.0), row(2, "t", "0", 1.0)]
    items, skipped = recipe.late_items(rows, team={"t": team(**{"0": 1.0, "1": 0.0, "2": 0.0})})
    assert skipped == {} and [i.experience_id for i in items] == ["e1", "e2"]
    assert all(i.late and i.advantage == approx(1 - 1 / 3) and i.weight == 0.5 for i in items)  # mean 1/3; 2 calls


def test_what_cannot_be_valued_is_set_down_with_why():
    recipe = cfg().algorithm.recipe()
    rows = [row(1, "t", "0", 1.0), row(2, "u", "0", 0.5), row(3, "v", "9", 1.0)]
    groups = {"t": team(**{"0": 1.0}), "u": team(**{"0": 0.5, "1": 0.5})}
    items, skipped = recipe.late_items(rows, team=groups)
    assert items == []
    assert skipped == {"e1": "group of 1 episodes < min_group_size 2", "e2": "no signal: every episode of the group scored 0.5",
                       "e3": "not an episode of a group (task_id and run_id)"}
    baseline = cfg("algorithm.grpo.flat_groups=baseline", "algorithm.grpo.flat_baseline=0.25").algorithm.recipe()
    items, _ = baseline.late_items([rows[1]], team=groups)
    assert items[0].advantage == approx(0.25)  # a flat group against the fixed baseline


@pytest.mark.parametrize("cap", [2.0, 1.2])  # e^0.5 = 1.65: under the cap, then truncated to it
def test_a_late_call_is_trained_against_the_trainers_own_policy_with_truncated_importance_weights(cap):
    recipe = cfg(f"algorithm.grpo.importance_cap={cap}").algorithm.recipe()
    items, _ = recipe.late_items([row(1, "t", "0", 1.0)], team={"t": team(**{"0": 1.0, "1": 0.0})})
    fresh = items[0].__class__(**{**items[0].__dict__, "late": False, "experience_id": "f"})
    # the policy now: -0.5 per token; recorded at sampling: -1.0 (late) -> weight e^0.5 = 1.65; the fresh row's
    # recorded logprobs are the policy's own (ratio 1)
    lp = torch.full((2, 2), -0.5, requires_grad=True)
    old = torch.tensor([[-1.0, -1.0], [-0.5, -0.5]])
    mask = torch.ones(2, 2)
    mb = MicroBatch(items=[items[0], fresh], logprobs=lp, old_logprobs=old, mask=mask, weights=torch.ones(2),
                    rewards=torch.zeros(2), hidden=None, value_head=None, norms=Norms(tokens=4.0, sequences=2.0),
                    objective=recipe.objective, sequence_level=False, key=0, first_epoch=True)
    loss, _ = recipe.loss(mb)
    loss.backward()
    a = items[0].advantage  # 1 (std-normalized: +1 and -1)
    w = min(torch.exp(torch.tensor(0.5)).item(), cap)
    # ratio against the proximal policy is 1: d loss / d lp = -A * w / 4 for the late row, -A / 4 for the fresh one
    assert lp.grad.tolist() == [[approx(-a * w / 4)] * 2, [approx(-a / 4)] * 2]


def test_retrain_needs_an_objective_that_can():
    assert cfg("late_rewards.mode=retrain").late_rewards.mode_of("x") == "retrain"
    assert cfg("late_rewards.agents={b: retrain}").late_rewards.mode_of("b") == "retrain"
    with pytest.raises(ConfigError, match="late_rewards: retrain needs an objective"):
        load_config(TrainerConfig, None, ["model.path=/m", "algorithm.name=rft", "late_rewards.mode=retrain"], env={})


def test_retrain_needs_token_level():
    with pytest.raises(ConfigError, match="needs algorithm.level token"):
        load_config(TrainerConfig, None, ["model.path=/m", "algorithm.name=grpo", "algorithm.level=sequence",
                                          "late_rewards.mode=retrain"], env={})
