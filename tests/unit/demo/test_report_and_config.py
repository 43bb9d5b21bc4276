"""The demo's statistics (Wilson interval, paired bootstrap of a gain) and its config defaults per task."""

from __future__ import annotations

import pytest

from services.common.config import load_config
from services.common.cpus import usable_cpus
from services.demo.config import DemoConfig
from services.demo.report import paired_gain_ci
from services.demo.tools_demo import mean_interval, wilson


def test_wilson_interval_worked_by_hand():
    # 0 of 64: centre z^2/2n / (1 + z^2/n) = 0.0300/1.0600 = 0.0283, half-width the same, so [0, 0.0566]
    low, high = wilson(0, 64)
    assert low == 0.0 and high == pytest.approx(0.0566, abs=1e-4)
    # 32 of 64: symmetric around 0.5, half-width 1.96 * sqrt(0.25/64 + 3.8416/16384) / 1.06 = 0.1190
    low, high = wilson(32, 64)
    assert (low + high) / 2 == pytest.approx(0.5) and high - 0.5 == pytest.approx(0.1190, abs=1e-4)
    assert wilson(64, 64)[1] == 1.0 and wilson(0, 0) == (0.0, 1.0)


def test_a_graded_mean_gets_the_normal_interval_clipped_to_0_and_1():
    # 0, 0.5, 1: mean 0.5, sample sd 0.5, half-width 1.96 * 0.5 / sqrt(3) = 0.566: clipped to [0, 1]
    assert mean_interval([0.0, 0.5, 1.0]) == (0.0, 1.0)
    # nine 0.5 and one 1: mean 0.55, sample sd 0.1581, half-width 1.96 * 0.1581 / sqrt(10) = 0.098
    low, high = mean_interval([0.5] * 9 + [1.0])
    assert (low + high) / 2 == pytest.approx(0.55) and high - 0.55 == pytest.approx(1.96 * 0.1581 / 10 ** 0.5, abs=1e-4)
    assert mean_interval([1.0]) == (0.0, 1.0)


def test_paired_bootstrap_of_a_gain():
    assert paired_gain_ci([0, 1, 0, 1], [0, 1, 0, 1]) == (0.0, 0.0)  # no question changed
    assert paired_gain_ci([0, 0, 0, 0], [1, 1, 1, 1]) == (1.0, 1.0)  # every question gained 1
    before, after = [0.0] * 50 + [1.0] * 50, [1.0] * 50 + [1.0] * 50  # half the questions gained 1: +0.5
    low, high = paired_gain_ci(before, after)
    assert 0.35 < low < 0.5 < high < 0.65


def test_each_task_has_its_own_defaults():
    tools = load_config(DemoConfig, None, [])
    assert (tools.task, tools.model_path, tools.agent, tools.duration_s) == ("tools", ".cache/smollm2-135m-instruct", "calculator", 420.0)
    # the loop: at least 7 minutes, then on until traffic was served by 24 new versions, at most 11.5 minutes
    assert (tools.min_new_versions, tools.max_duration_s) == (24, 690.0)
    # the unit converter's loop stops sooner: its calls are longer, so are its measurements, and the demo stays in 15 minutes
    units = load_config(DemoConfig, None, ["tools.task=units"])
    assert (units.agent, units.min_new_versions, units.max_duration_s) == ("converter", 24, 640.0)
    assert load_config(DemoConfig, None, ["tools.task=units", "max_duration_s=900"]).max_duration_s == 900.0
    parity = load_config(DemoConfig, None, ["task=parity", "duration_s=30"])
    assert (parity.model_path, parity.agent, parity.duration_s) == (".cache/tiny-model", "parity", 30.0)
    assert (parity.min_new_versions, parity.max_duration_s) == (0, 120.0)
    assert load_config(DemoConfig, None, ["task=parity"]).max_duration_s == 1200.0


def test_a_loop_duration_of_ones_own_stops_at_it_unless_told_otherwise():
    from services.common.config import ConfigError

    short = load_config(DemoConfig, None, ["duration_s=150"])  # DEMO.md's short loops stay short
    assert (short.duration_s, short.min_new_versions, short.max_duration_s) == (150.0, 0, 600.0)
    versions = load_config(DemoConfig, None, ["duration_s=1", "min_new_versions=12", "max_duration_s=7200"])  # the bench's
    assert (versions.duration_s, versions.min_new_versions, versions.max_duration_s) == (1.0, 12, 7200.0)
    capped = load_config(DemoConfig, None, ["max_duration_s=900"])
    assert (capped.duration_s, capped.min_new_versions, capped.max_duration_s) == (420.0, 24, 900.0)
    assert load_config(DemoConfig, None, ["min_new_versions=0"]).min_new_versions == 0  # the 7 minutes alone
    with pytest.raises(ConfigError, match=r"max_duration_s=300 is shorter than duration_s=420 \(the tools task's default: set duration_s too\)"):
        load_config(DemoConfig, None, ["max_duration_s=300"])
    with pytest.raises(ConfigError, match=r"max_duration_s=100 is shorter than duration_s=200 \(got"):
        load_config(DemoConfig, None, ["duration_s=200", "max_duration_s=100"])


def test_a_partial_traffic_section_keeps_the_task_defaults_for_the_rest():
    cfg = load_config(DemoConfig, None, ["tools.traffic.repeat=8", "parity.traffic.concurrency=3"])
    assert (cfg.tools.traffic.tasks_per_batch, cfg.tools.traffic.repeat, cfg.tools.traffic.max_backlog) == (2, 8, 32)
    assert (cfg.parity.traffic.tasks_per_batch, cfg.parity.traffic.concurrency) == (16, 3)


def test_unknown_keys_are_refused():
    from services.common.config import ConfigError

    with pytest.raises(ConfigError, match="tools.nope"):
        load_config(DemoConfig, None, ["tools.nope=1"])
    with pytest.raises(ConfigError):
        load_config(DemoConfig, None, ["task=chess"])


def test_words_hints_give_the_trainer_its_hint_term_and_are_refused_when_unknown(tmp_path):
    from services.common.launch import Stack
    from services.demo.tools_demo import ENGINE_REPLICAS, ToolsDemo
    from services.trainer.config import TrainerConfig

    def trainer(*overrides):
        cfg = load_config(DemoConfig, None, ["task=tools", *overrides], env={})
        return ToolsDemo(cfg, Stack(tmp_path, cfg.agent, config_models={"trainer": TrainerConfig})).trainer_config()

    assert trainer()["algorithm"]["grpo"].get("hint_coef") is None
    # the loop takes turns, so a Trainer step gets every core this process may use; a user's setting wins
    assert trainer()["trainer"]["torch_threads"] == usable_cpus()
    assert trainer("trainer.trainer.torch_threads=1")["trainer"]["torch_threads"] == 1

    def engine(*overrides):
        cfg = load_config(DemoConfig, None, ["task=tools", *overrides], env={})
        return ToolsDemo(cfg, Stack(tmp_path, cfg.agent, config_models={"trainer": TrainerConfig})).explorer_config()["engine"]

    # and a round of traffic too: an engine replica of one thread a core (at most ENGINE_REPLICAS); a user's setting wins
    assert (engine()["replicas"], engine()["torch_threads"]) == (max(1, min(usable_cpus(), ENGINE_REPLICAS)), 1)
    assert engine("explorer.engine.replicas=1")["replicas"] == 1
    hinted = trainer("tools.words=hints", "tools.hint_coef=0.5")["algorithm"]
    assert hinted["grpo"]["hint_coef"] == 0.5 and hinted["level"] == "token"
    assert trainer("tools.words=corrections")["algorithm"]["grpo"].get("hint_coef") is None
    with pytest.raises(Exception, match="words"):
        trainer("tools.words=shouts")
    with pytest.raises(Exception, match="hint_calls"):
        trainer("tools.words=hints", "tools.hint_calls=answer")
    with pytest.raises(Exception, match="hint_calls=tool says which calls get a hint: it needs words=hints, not words=off"):
        trainer("tools.hint_calls=tool")
    assert trainer("tools.words=hints", "tools.hint_calls=tool")["algorithm"]["grpo"]["hint_coef"] == 1.0
    with pytest.raises(Exception, match="correct_runs=all says which runs get a correction: it needs words=corrections"):
        trainer("tools.words=hints", "tools.correct_runs=all")
    with pytest.raises(Exception, match="correct_runs"):
        trainer("tools.words=corrections", "tools.correct_runs=some")
    assert trainer("tools.words=corrections", "tools.correct_runs=all")["algorithm"]["grpo"].get("hint_coef") is None


def test_the_demo_sets_flat_groups_aside_at_most_16_at_a_time_but_keeps_them_with_hints(tmp_path):
    from services.common.launch import Stack
    from services.demo.tools_demo import ToolsDemo
    from services.trainer.config import TrainerConfig

    def grpo(*overrides):
        cfg = load_config(DemoConfig, None, ["task=tools", *overrides], env={})
        return ToolsDemo(cfg, Stack(tmp_path, cfg.agent, config_models={"trainer": TrainerConfig})).trainer_config()["algorithm"]["grpo"]

    assert (grpo()["flat_groups"], grpo()["flat_max_set_aside"]) == ("discard", 16)  # the bench's explore-bounded
    assert grpo("tools.words=corrections")["flat_groups"] == "discard"
    assert grpo("tools.words=hints")["flat_groups"] == "keep"  # an all-wrong group's hints would go untrained
    assert grpo("tools.levers=true")["flat_groups"] == "baseline"  # the levers train flat groups against a baseline
    assert grpo("trainer.algorithm.grpo.flat_groups=keep")["flat_groups"] == "keep"  # the bench's explore-kept


def test_explore_temperature_gives_the_agent_its_exploration_temperature(tmp_path):
    from services.common.config import ConfigError
    from services.common.launch import Stack
    from services.demo.tools_demo import ToolsDemo
    from services.explorer.config import ExplorerConfig

    def explorer(*overrides):
        cfg = load_config(DemoConfig, None, ["task=tools", "release_check=false", *overrides], env={})
        return ToolsDemo(cfg, Stack(tmp_path, cfg.agent, config_models={"explorer": ExplorerConfig})).explorer_config()

    assert "exploration_temperature" not in explorer("tools.explore_temperature=null")["agents"]
    assert explorer()["agents"]["exploration_temperature"] == {"calculator": 1.3}  # the demo's default
    hot = explorer("tools.explore_temperature=1.3")["agents"]
    assert hot["exploration_temperature"] == {"calculator": 1.3} and "calculator" in hot["names"]
    # without the control arm there is no agents section of the demo's own: the temperature still reaches it
    alone = explorer("tools.explore_temperature=1.3", "tools.control=false")["agents"]
    assert alone["exploration_temperature"] == {"calculator": 1.3}
    with pytest.raises(ConfigError, match="explore_temperature"):
        load_config(DemoConfig, None, ["tools.explore_temperature=3"])


def test_the_units_task_has_its_own_agent_kinds_and_tokens_and_the_release_gate_asks_its_questions(tmp_path):
    from services.common.config import ConfigError
    from services.common.launch import Stack
    from services.demo.tools_demo import ToolsDemo
    from services.explorer.config import ExplorerConfig

    calc = load_config(DemoConfig, None, [], env={})
    assert (calc.tools.task, calc.tools.demonstrated_operations, calc.tools.max_tokens) == ("calculator", "*+-/", 40)
    units = load_config(DemoConfig, None, ["tools.task=units"], env={})
    assert (units.agent, units.tools.demonstrated_operations, units.tools.max_tokens) == ("converter", "lmvt", 52)
    assert load_config(DemoConfig, None, ["tools.task=units", "tools.demonstrated_operations=lt"], env={}).tools.demonstrated_operations == "lt"
    with pytest.raises(ConfigError, match="demonstrated_operations must be some of 'lmvt' for task units"):
        load_config(DemoConfig, None, ["tools.task=units", "tools.demonstrated_operations=*+"], env={})
    with pytest.raises(ConfigError, match="tools.task"):
        load_config(DemoConfig, None, ["tools.task=maps"], env={})
    demo = ToolsDemo(units, Stack(tmp_path, units.agent, config_models={"explorer": ExplorerConfig}))
    assert demo.task.tool_name == "convert" and {p.task for p in demo.split.heldout} == {"units"}
    assert "units_gate_problems" in str(demo.explorer_config()["release"])


def test_keep_best_draws_the_validation_problems_last_and_every_version_stays(tmp_path):
    from services.common.launch import Stack
    from services.demo.tools_demo import ToolsDemo
    from services.trainer.config import TrainerConfig

    def demo(*overrides):
        cfg = load_config(DemoConfig, None, ["task=tools", "release_check=false", *overrides], env={})
        return ToolsDemo(cfg, Stack(tmp_path, cfg.agent, config_models={"trainer": TrainerConfig}))

    plain, kept = demo(), demo("tools.keep_best=true", "tools.plateau.validation=12")
    assert plain.split.validation == [] and len(kept.split.validation) == 12
    assert kept.split.heldout == plain.split.heldout and kept.split.traffic == plain.split.traffic  # drawn last
    assert kept.trainer_config()["checkpoints"]["keep_versions"] >= 1000  # the demo's Stack keeps every version to choose from


def test_gate_every_makes_the_trainer_publish_candidates_that_the_explorer_gates_every_nth(tmp_path):
    from services.common.config import ConfigError
    from services.common.launch import Stack
    from services.demo.tools_demo import ToolsDemo
    from services.explorer.config import ExplorerConfig
    from services.trainer.config import TrainerConfig

    def demo(*overrides):
        cfg = load_config(DemoConfig, None, ["task=tools", *overrides], env={})
        return ToolsDemo(cfg, Stack(tmp_path, cfg.agent, config_models={"trainer": TrainerConfig, "explorer": ExplorerConfig}))

    # the calculator's loop is gated by default (every 4th version, no_harm, against the best), from a cold start of 8
    # steps; the units task's is not (0: immediate), from 4; tools.gate_every=0 turns the calculator's off
    default, units, plain = demo(), demo("tools.task=units"), demo("tools.gate_every=0")
    for cfg in (default.trainer_config(), default.explorer_config()):  # the same section in both, validated by each
        gate = cfg["release"]["gate"]
        assert (cfg["release"]["mode"], gate["every"], gate["rule"], gate["tolerance"], gate["against"]) == (
            "gated", 4, "no_harm", 0.0, "best")
        assert gate["suite"]["dataset"] == "services.demo.agent_app:gate_problems"
    assert default.trainer_config()["algorithm"]["cold_start_steps"] == 8
    assert (units.t.gate_every, units.trainer_config()["algorithm"]["cold_start_steps"]) == (0, 4)
    assert units.explorer_config()["release"]["gate"]["suite"]["dataset"] == "services.demo.agent_app:units_gate_problems"
    for off in (plain, units):
        assert "release" not in off.trainer_config()  # immediate: the loop's versions serve at once
        assert off.explorer_config()["release"]["gate"]["every"] == 1  # the release check's candidates, each measured
    assert demo("tools.task=units", "tools.gate_every=4").trainer_config()["release"]["gate"]["every"] == 4
    # without the release check the Explorer still gates the loop's versions
    assert demo("tools.gate_every=2", "release_check=false").explorer_config()["release"]["gate"]["every"] == 2
    assert "release" not in demo("tools.gate_every=0", "release_check=false").explorer_config()
    with pytest.raises(ConfigError, match="gate_every"):
        load_config(DemoConfig, None, ["tools.gate_every=-1"], env={})
    # tools.gate_rule: the same rule in both services' sections, with its tolerance
    first = demo("tools.gate_rule=non_inferiority", "tools.gate_against=last")
    for cfg in (first.trainer_config(), first.explorer_config()):
        assert (cfg["release"]["gate"]["rule"], cfg["release"]["gate"]["tolerance"], cfg["release"]["gate"]["against"]) == (
            "non_inferiority", 0.1, "last")
    with pytest.raises(ConfigError, match="gate_rule"):
        load_config(DemoConfig, None, ["tools.gate_rule=lenient"], env={})
    with pytest.raises(ConfigError, match="gate_against"):
        load_config(DemoConfig, None, ["tools.gate_against=first"], env={})


def test_loop_gate_counts_the_loops_own_gate_decisions(tmp_path):
    """The report's line on tools.gate_every: measured versions, the ones that served unmeasured, those rolled
    back, from the release decisions in the buffer (the release check's candidates are not the loop's)."""
    from types import SimpleNamespace

    from services.common import buffer
    from services.demo.report import loop_gate

    url = f"sqlite:///{tmp_path}/b.db"
    db = buffer.create_buffer_engine(url)
    between = {"between_gates": True, "anchor": 4}
    for v, decision, actor, figures in (
            (5, "candidate", "trainer", None), (5, "promoted", "gate", between), (6, "promoted", "gate", between),
            (7, "promoted", "gate", {"anchor": 4, "diff": 0.1, "lower": -0.02, "upper": 0.2, "rule": "non_inferiority"}),
            (8, "promoted", "gate", {**between, "anchor": 7}), (8, "rolled_back", "gate", {"refused": [8]}),
            (9, "rejected", "gate", {"anchor": 7, "diff": -0.2, "lower": -0.3, "upper": -0.1, "rule": "no_harm",
                                     "best": 7, "scores": {"against": [1.0, 1.0], "candidate": [1.0, 0.0]}}),
            (10, "rejected", "gate", {"diff": -0.8}), (11, "promoted", "gate", {"diff": 0.0})):  # 10, 11: the release check's
        buffer.record_decision(engine=db, agent="calculator", version=v, decision=decision, serving=None, actor=actor,
                               figures=figures)
    db.dispose()
    got = loop_gate(SimpleNamespace(db_url=url, agent="calculator"), [{"version": 10}, {"version": 11}])
    assert got == {"measured": [{"version": 7, "decision": "promoted", "anchor": 4, "diff": 0.1, "lower": -0.02,
                                 "upper": 0.2, "rule": "non_inferiority", "best": None, "scores": None},
                                {"version": 9, "decision": "rejected", "anchor": 7, "diff": -0.2, "lower": -0.3,
                                 "upper": -0.1, "rule": "no_harm", "best": 7,
                                 "scores": {"against": [1.0, 1.0], "candidate": [1.0, 0.0]}}],
                   "between_gates": 3, "rolled_back": 1}


def test_the_cold_start_wait_goes_on_from_what_serves_when_the_gate_rejected_its_last_version(tmp_path):
    """tools.gate_every: the cold start's last version is measured like any other; rejected, it never serves,
    and the demo goes on from the version the gate rolled back to instead of waiting for it (real SQLite buffer
    and checkpoint pointers; the Explorer's answer to "what serves" is the one thing stood in for)."""
    from services.common import buffer, checkpoints
    from services.common.launch import Stack
    from services.demo.tools_demo import ToolsDemo

    cfg = load_config(DemoConfig, None, ["task=tools"], env={})
    stack = Stack(tmp_path, cfg.agent)
    buffer.create_buffer_engine(stack.db_url, create_tables=True).dispose()
    demo = ToolsDemo(cfg, stack)
    serving = {"version": 4}
    stack.serving = lambda agent=None: dict(serving)
    stack.check_alive = lambda: None
    checkpoints.set_latest(stack.root, cfg.agent, 4)

    with pytest.raises(TimeoutError, match="v8 not served"):  # v8 undecided: it is waited for
        demo.wait_for_version(8, timeout_s=0.05, poll_s=0.01)
    db = buffer.create_buffer_engine(stack.db_url, create_tables=False)
    buffer.record_decision(engine=db, agent=cfg.agent, version=8, decision="rejected", serving=4, actor="gate", reason="worse")
    db.dispose()
    assert demo.wait_for_version(8, timeout_s=5, poll_s=0.01) == 4  # rejected, v4 (LATEST) serving: go on from it
    checkpoints.set_latest(stack.root, cfg.agent, 6)  # LATEST moved on, the Explorer not yet: still waited for
    with pytest.raises(TimeoutError):
        demo.wait_for_version(8, timeout_s=0.05, poll_s=0.01)
    serving["version"] = 9  # a later version serves: past it
    assert demo.wait_for_version(8, timeout_s=5, poll_s=0.01) == 9


def test_adaptive_groups_size_the_trainer_by_a_rounds_first_runs_and_refuse_inconsistent_sizes(tmp_path):
    from runner_sdk import AdaptiveRepeat
    from services.common.config import ConfigError
    from services.common.launch import Stack
    from services.demo.tools_demo import ToolsDemo
    from services.trainer.config import TrainerConfig

    def trainer(*overrides):
        cfg = load_config(DemoConfig, None, ["task=tools", *overrides], env={})
        return ToolsDemo(cfg, Stack(tmp_path, cfg.agent, config_models={"trainer": TrainerConfig})).trainer_config()

    plain = trainer()  # 2 problems a round, 8 runs each, at once: groups of 8, 2 calls an episode
    assert (plain["algorithm"]["grpo"]["group_size"], plain["train_batch_size"]) == (8, 32)
    adaptive = trainer("tools.traffic.tasks_per_batch=4", "tools.traffic.first_runs=4", "tools.traffic.failed_runs=16")
    # groups of 4, 8 or 16, each committed whole: none waits for a size; a step is a round's first runs' calls
    assert (adaptive["algorithm"]["grpo"]["group_size"], adaptive["train_batch_size"]) == (None, 32)
    cfg = load_config(DemoConfig, None, ["tools.traffic.first_runs=4", "tools.traffic.failed_runs=16"])
    assert cfg.tools.traffic.adaptive() == AdaptiveRepeat(first=4, full=8, failed=16)
    for overrides, message in ((["tools.traffic.first_runs=9"], r"traffic.first_runs \(9\) must be at most traffic.repeat \(8\)"),
                               (["tools.traffic.first_runs=4", "tools.traffic.failed_runs=6"],
                                r"traffic.failed_runs \(6\) must be at least traffic.repeat \(8\)"),
                               (["tools.traffic.failed_runs=16"], "traffic.failed_runs needs traffic.first_runs")):
        with pytest.raises(ConfigError, match=message):
            load_config(DemoConfig, None, overrides)
