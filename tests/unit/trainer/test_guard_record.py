"""What the guard's figures look like once they leave the learners: merged over learners (the same on
every one), in the step record, and in the log line when the guard acted."""

from __future__ import annotations

import pytest

from services.common.config import load_config
from services.trainer.batches import Norms, Selection
from services.trainer.config import TrainerConfig
from services.trainer.metrics import _guard_note
from services.trainer.recipes.ppo import PPO, PPOConfig
from services.trainer.stats import StepStats, step_record


def _record(total: StepStats) -> dict:
    ppo = PPO(PPOConfig(), load_config(TrainerConfig, None, ["model.path=/m", "algorithm.name=ppo"], env={}).algorithm)
    return step_record(agent="a", step=1, version=1, algorithm="ppo", recipe=ppo, published=0, selection=Selection(),
                       total=total, norms=Norms(tokens=16.0, sequences=2.0), seconds=1.0)


def test_the_kl_is_the_first_learners_not_a_sum_and_reaches_the_record_alone():
    # every learner holds the pooled KL and the shared verdict (learner.py all-reduces both)
    a = StepStats(tokens=10, guard_kl=0.3, guard_attempts=2.0, guard_refused=1.0)
    b = StepStats(tokens=6, guard_kl=0.3, guard_attempts=2.0, guard_refused=1.0)
    m = StepStats.merged([a, b])
    assert m.tokens == 16 and m.guard_kl == 0.3 and m.guard_attempts == 2.0 and m.guard_refused == 1.0
    rec = _record(m)  # a KL guard without demonstrations: no NLL figures
    assert rec["guard_kl"] == 0.3 and rec["guard_attempts"] == 2 and rec["guard_refused"] is True
    assert "guard_nll_before" not in rec and "guard_nll_after" not in rec
    assert not {k for k in _record(StepStats(tokens=16)) if k.startswith("guard")}  # no guard: no figures


def test_the_log_line_names_each_test_that_ran():
    kl_only = {"guard_kl": 1.23456, "guard_attempts": 2, "guard_refused": True}
    assert _guard_note(kl_only) == " | GUARD REFUSED 2 update(s): kl on its samples 1.2346; weights unchanged"
    both = {"guard_nll_before": 0.01, "guard_nll_after": 0.015, "guard_kl": 0.5, "guard_attempts": 2,
            "guard_refused": False, "lr": 0.0005}
    assert _guard_note(both) == " | guard: redone at lr 0.0005 (demonstrations' nll 0.0100 -> 0.0150, kl on its samples 0.5000)"
    assert _guard_note({"guard_kl": 0.01, "guard_attempts": 1, "guard_refused": False}) == ""


def test_max_kl_is_off_by_default_and_must_be_positive():
    assert TrainerConfig.model_validate({"model": {"path": "m"}}).guard.max_kl is None
    with pytest.raises(ValueError, match="max_kl"):
        TrainerConfig.model_validate({"model": {"path": "m"}, "guard": {"max_kl": 0}})
