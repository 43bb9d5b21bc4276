"""The recipe seam: a recipe's own config section, whether it needs a reward, and its statistics
passing through the learner's sums into the step record unnamed."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from pytest import approx

from services.common.config import ConfigError, load_config
from services.common.records import CommittedExperience
from services.trainer.batches import Norms, Selection, select_batch
from services.trainer.config import TrainerConfig
from services.trainer.recipes import REGISTRY, BaseRecipe, recipe_class
from services.trainer.recipes.grpo import GRPOConfig
from services.trainer.recipes.ppo import PPO, PPOConfig
from services.trainer.stats import StepStats, step_record

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def cfg(*overrides: str) -> TrainerConfig:
    return load_config(TrainerConfig, None, ["model.path=/m", *overrides], env={})


def row(i: int, *, reward: float | None = 1.0, labels: tuple[str, ...] = ()) -> CommittedExperience:
    return CommittedExperience(
        experience_id=f"e{i}", agent="a", task_id=f"t{i}", run_id=None, seq=i, model_version=0,
        prompt_token_ids=[1, 2], response_token_ids=[3], response_logprobs=[-0.5], reward=reward,
        sampling={}, feedback={"labels": list(labels)}, finish_reason="stop", created_at=NOW, updated_at=NOW,
    )


def test_a_recipe_owns_its_section_and_unknown_keys_are_named():
    c = cfg("algorithm.name=grpo", "algorithm.grpo.group_size=4", "algorithm.ppo.gamma=0.9")
    assert isinstance(c.algorithm.section(), GRPOConfig) and c.algorithm.section().group_size == 4
    assert c.algorithm.recipe().config.group_size == 4
    # a section of a recipe not chosen is checked too, and survives the round trip to the learners
    again = TrainerConfig.model_validate(c.model_dump(mode="json"))
    assert again.algorithm.section().group_size == 4 and again.algorithm.model_dump()["ppo"]["gamma"] == 0.9
    with pytest.raises(ConfigError, match="bogus"):
        cfg("algorithm.grpo.bogus=1")
    with pytest.raises(ConfigError, match="algorithm.nope"):
        cfg("algorithm.nope.x=1")
    with pytest.raises(ConfigError, match="unknown algorithm 'dpo'"):
        cfg("algorithm.name=dpo")
    with pytest.raises(ConfigError, match="sft needs algorithm.sft.label or algorithm.sft.min_reward"):
        cfg("algorithm.name=sft", "algorithm.sft.label=null")


def test_flat_keys_of_older_configs_move_into_their_recipes_section(caplog):
    c = cfg("algorithm.name=ppo", "algorithm.gamma=0.5", "algorithm.std_normalize=false")
    assert c.algorithm.section() == PPOConfig(gamma=0.5)
    assert c.algorithm.model_dump()["grpo"]["std_normalize"] is False
    assert "algorithm.gamma is now algorithm.ppo.gamma" in caplog.text
    # the chosen recipe claims a key several recipes know
    assert cfg("algorithm.name=rft", "algorithm.sft_min_reward=0.5").algorithm.section().min_reward == 0.5


def test_sft_trains_labelled_rows_without_a_reward_and_grpo_needs_one():
    rows = [row(1, reward=None, labels=("demonstration",)), row(2, reward=None), row(3, reward=0.0)]
    c = cfg("algorithm.name=sft", "train_batch_size=1")
    sel = select_batch(rows, recipe=c.algorithm.recipe(), cfg=c, current_version=0, now=NOW)
    assert [i.experience_id for i in sel.items] == ["e1"] and sel.items[0].reward is None
    assert sel.discarded == {"e2": "not labelled 'demonstration'", "e3": "not labelled 'demonstration'"}
    g = cfg("algorithm.name=grpo", "train_batch_size=1")
    sel = select_batch(rows, recipe=g.algorithm.recipe(), cfg=g, current_version=0, now=NOW)
    assert sel.discarded["e1"] == "no reward" and sel.discarded["e2"] == "no reward"


def test_rft_imitates_the_rewarded_traffic_only():
    c = cfg("algorithm.name=rft", "train_batch_size=2", "algorithm.rft.min_reward=0.8")
    sel = select_batch([row(1, reward=0.9), row(2, reward=0.5), row(3, reward=1.0)], recipe=c.algorithm.recipe(), cfg=c,
                       current_version=0, now=NOW)
    assert [i.experience_id for i in sel.items] == ["e1", "e3"]
    assert sel.discarded == {"e2": "reward 0.5 below algorithm.rft.min_reward 0.8"}


def test_objective_statistics_are_summed_by_name_and_reach_the_step_record_unnamed():
    # two learners, each a share of the batch: clip fractions 0.25 + 0.125 of the batch's tokens
    a, b = StepStats(tokens=6.0, loss=0.5), StepStats(tokens=2.0, loss=0.25)
    a.add_objective({"clip_frac": 0.25, "adv_sum": 3.0, "adv_sq_sum": 5.0, "adv_count": 4.0, "value_sum": 2.0})
    b.add_objective({"clip_frac": 0.125, "adv_sum": -1.0, "adv_sq_sum": 3.0, "adv_count": 4.0, "value_sum": 2.0})
    total = StepStats.merged([a, b])
    assert total.objective["clip_frac"] == approx(0.375) and total.tokens == 8.0 and total.loss == 0.75
    # PPO's own figures: advantages 2/8 = 0.25 mean, E[a^2] = 8/8 = 1, std sqrt(1 - 0.0625); value 4/8 tokens
    ppo = PPO(PPOConfig(), cfg("algorithm.name=ppo").algorithm)
    rec = step_record(agent="a", step=1, version=1, algorithm="ppo", recipe=ppo, published=0, selection=Selection(),
                      total=total, norms=Norms(tokens=8.0, sequences=2.0), seconds=1.0)
    assert rec["advantage_mean"] == approx(0.25) and rec["advantage_std"] == approx(0.9375**0.5)
    assert rec["value_mean"] == approx(0.5) and rec["clip_frac"] == approx(0.375)
    assert rec["objective_figures"] == ["advantage_mean", "advantage_std", "clip_frac", "value_mean"]
    assert "adv_sum" not in rec and rec["loss"] == 0.75


class Halve(BaseRecipe):
    name = "halve_test"

    def loss(self, mb):
        return mb.logprobs.sum() * 0.5, {}


def test_an_objective_named_by_module_and_class_is_loaded_and_registered():
    try:
        assert recipe_class(f"{__name__}:Halve") is Halve and REGISTRY["halve_test"] is Halve
        assert cfg(f"algorithm.name={__name__}:Halve").algorithm.recipe().name == "halve_test"
        with pytest.raises(ValueError, match="not a recipe"):
            recipe_class(f"{__name__}:NOW")
    finally:
        REGISTRY.pop("halve_test", None)
