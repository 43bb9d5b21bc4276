"""round_robin: whose turn it is follows from the recorded trainer steps alone."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from services.common.config import ConfigError, load_config
from services.trainer.config import TrainerConfig
from services.trainer.schedule import Turn, current_turn

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
ORDER = ["planner", "solver"]


def _steps(*agents: str) -> list[tuple[str, datetime]]:
    """Steps in the order they were made; returned newest first, as the buffer gives them."""
    return [(a, T0 + timedelta(seconds=k)) for k, a in enumerate(agents)][::-1]


def test_the_first_turn_is_the_first_agents():
    assert current_turn([], ORDER, 2) == Turn("planner", 0, None)


@pytest.mark.parametrize("made, expected_agent, done", [
    (["planner"], "planner", 1),
    (["planner", "planner"], "solver", 0),
    (["planner", "planner", "solver"], "solver", 1),
    (["planner", "planner", "solver", "solver"], "planner", 0),
    (["planner", "planner", "solver", "solver", "planner"], "planner", 1),
])
def test_each_agent_trains_interval_steps_then_passes_the_turn(made, expected_agent, done):
    turn = current_turn(_steps(*made), ORDER, 2)
    assert (turn.agent, turn.steps_done) == (expected_agent, done)


def test_the_turn_starts_at_the_previous_agents_last_step():
    steps = _steps("planner", "planner", "solver")
    assert current_turn(steps, ORDER, 2).started_at == T0 + timedelta(seconds=1)  # planner's second step
    assert current_turn(_steps("planner", "planner"), ORDER, 2).started_at == T0 + timedelta(seconds=1)
    assert current_turn(_steps("planner"), ORDER, 2).started_at is None  # still the very first turn


def test_steps_of_agents_outside_the_schedule_are_ignored_and_the_order_wraps():
    steps = _steps("a", "b", "other", "c")
    assert current_turn(steps, ["a", "b", "c"], 1) == Turn("a", 0, T0 + timedelta(seconds=3))


def test_a_longer_run_than_the_interval_passes_the_turn():
    """The interval was lowered between runs: the agent that over-ran hands over at once."""
    assert current_turn(_steps("planner", "planner", "planner"), ORDER, 2).agent == "solver"


def _config(*overrides: str) -> TrainerConfig:
    return load_config(TrainerConfig, None, ["model.path=m", *overrides], env={})


def test_round_robin_needs_an_order():
    with pytest.raises(ConfigError, match="needs the agents' order"):
        _config("trainer.schedule.mode=round_robin")
    assert _config("trainer.schedule.mode=round_robin", "trainer.agents=[planner,solver]").trainer.schedule.interval == 1
    with pytest.raises(ConfigError, match=r"outside trainer.agents: \['critic'\]"):
        _config("trainer.schedule.mode=round_robin", "trainer.agents=[planner]", "trainer.schedule.order=[planner,critic]")
