"""What the demo measures at the end of its online loop (services/demo/tools_demo.py): the version the
loop ended on, unless it is the cold start's, measured already (loop_end); with tools.keep_best, the
loop's best version on the validation problems (keep_loop_best); the release check beside the control arm
only once the arm's model is built (_final_and_arms)."""

from __future__ import annotations

import asyncio

import pytest

from services.demo.loop import EvalResult
from services.demo.tools_demo import loop_end


class _Demo:
    """The one thing loop_end may call on a ToolsDemo: evaluate, recorded."""

    def __init__(self):
        self.measured: list[tuple[str, int]] = []

    async def evaluate(self, label, version, agent=None, problems=None):
        self.measured.append((label, version))
        return EvalResult(label, version, 0.5, 0.3, 0.7, [1.0, 0.0], 3.0)


COLD = EvalResult("after cold start", 4, 0.25, 0.1, 0.5, [0.0, 1.0, 0.0, 0.0], 9.0)


def test_a_loop_that_published_nothing_keeps_the_cold_starts_measurement():
    demo = _Demo()
    end = asyncio.run(loop_end(demo, COLD, 4))
    assert demo.measured == []  # no second measurement of the same version
    assert (end.label, end.version, end.per_prompt, end.mean, end.low, end.high) == (
        "after online loop", 4, COLD.per_prompt, COLD.mean, COLD.low, COLD.high)
    assert end.seconds == 0.0  # none spent


@pytest.mark.parametrize("final_version", [5, 16])
def test_a_newer_version_is_measured(final_version):
    demo = _Demo()
    end = asyncio.run(loop_end(demo, COLD, final_version))
    assert demo.measured == [("after online loop", final_version)] and end.per_prompt == [1.0, 0.0]


class _ValidationDemo(_Demo):
    """A ToolsDemo for keep_loop_best: validation scores by version (made up), held-out ones recorded."""

    def __init__(self, scores: dict[int, float], every: int = 4):
        super().__init__()
        from types import SimpleNamespace

        self.scores = scores
        self.t = SimpleNamespace(plateau=SimpleNamespace(every=every))
        self.cfg = SimpleNamespace(agent="calculator")
        self.split = SimpleNamespace(validation=["p"] * 40)

    async def evaluate(self, label, version, agent=None, problems=None):
        if problems is not None:  # a validation measurement
            self.measured.append(("validation", version))
            return EvalResult(label, version, self.scores[version], 0.0, 1.0, [], 1.0)
        return await super().evaluate(label, version, agent, problems)


def _keep(scores: dict[int, float], final_version: int, known: dict | None = None):
    from services.demo.tools_demo import Arms, Validation, keep_loop_best

    demo = _ValidationDemo(scores)
    final = EvalResult("after online loop", final_version, 0.6, 0.5, 0.7, [1.0, 1.0, 0.0], 9.0)
    out, validation = Arms(final), Validation(demo)
    validation.scores.update(known or {})
    asyncio.run(keep_loop_best(demo, COLD, final, validation, out))
    return demo, out


def test_the_loop_keeps_its_earliest_best_version_on_validation_and_measures_it_on_the_held_out_problems():
    # the cold start is v4; the loop ended at v17 (13 steps): measured at 0, 4, 8, 12 and 13 steps
    demo, out = _keep({4: 0.2, 8: 0.5, 12: 0.7, 16: 0.7, 17: 0.6}, 17)
    assert demo.measured == [("validation", 4), ("validation", 8), ("validation", 12), ("validation", 16), ("validation", 17),
                             ("online loop, best on validation (8 steps)", 12)]  # 8 and 12 steps tie: the earlier
    assert [(p["steps"], p["version"], p["validation"]) for p in out.loop_curve] == [
        (0, 4, 0.2), (4, 8, 0.5), (8, 12, 0.7), (12, 16, 0.7), (13, 17, 0.6)]
    assert (out.kept.label, out.kept.version, out.kept.per_prompt) == ("online loop, best on validation (8 steps)", 12, [1.0, 0.0])


def test_a_best_at_either_end_is_not_measured_twice():
    demo, out = _keep({4: 0.2, 8: 0.5, 9: 0.6}, 9)  # the last is best
    assert demo.measured == [("validation", 4), ("validation", 8), ("validation", 9)]
    assert (out.kept.label, out.kept.version, out.kept.per_prompt) == ("online loop, best on validation (5 steps)", 9, [1.0, 1.0, 0.0])
    # the cold start best, its validation score known already (the demonstrations-only arm's first point)
    demo, out = _keep({8: 0.1, 9: 0.2}, 9, known={("calculator", 4): 0.3})
    assert demo.measured == [("validation", 8), ("validation", 9)]
    assert (out.kept.version, out.kept.per_prompt) == (4, COLD.per_prompt) and out.loop_curve[0]["validation"] == 0.3


def test_a_loop_that_published_nothing_keeps_the_cold_start():
    demo, out = _keep({4: 0.3}, 4)
    assert demo.measured == [("validation", 4)] and [p["steps"] for p in out.loop_curve] == [0]
    assert (out.kept.label, out.kept.version, out.kept.per_prompt) == ("online loop, best on validation (0 steps)", 4, [1.0, 1.0, 0.0])


class _ArmDemo(_Demo):
    """A ToolsDemo for _final_and_arms: a control arm slow to build (its model loaded on the arm's thread)
    whose training waits for the release check (so the check must run beside it), what happens recorded
    in order."""

    def __init__(self, control: bool = True, broken: bool = False):
        super().__init__()
        import threading
        from types import SimpleNamespace

        self.t = SimpleNamespace(control=control, keep_best=False, plateau=SimpleNamespace(max_steps=0, every=4, patience=2))
        self.cfg = SimpleNamespace(agent="calculator")
        self.control_agent = "calculator-sft-only"
        self.events: list[str] = []
        self.checked = threading.Event()
        self.broken = broken

    def demonstrations_only(self, trainer_cfg, start_version):
        import time

        time.sleep(0.3)  # loading the model, importing transformers on the way
        if self.broken:
            raise RuntimeError("no model here")
        self.events.append("arm built")
        demo = self

        class _Arm:
            version = start_version

            def train(self, steps):
                if not demo.checked.wait(5):
                    raise AssertionError("the release check did not run while the arm trained")
                demo.events.append("arm trained")
                self.version += steps
                return self.version

        return _Arm()

    def wait_for_agent_version(self, agent, version):
        self.events.append(f"{agent} serves v{version}")

    async def evaluate(self, label, version, agent=None, problems=None):
        self.events.append(f"measured {label}")
        return await super().evaluate(label, version, agent, problems)

    async def beside(self):
        self.events.append("release check")
        self.checked.set()


@pytest.mark.parametrize("final_version,loop_steps", [(4, 0), (16, 12), (12, 16)])
def test_the_release_check_runs_beside_the_arm_once_its_model_is_built(final_version, loop_steps):
    """beside (the release check) imports transformers on its own thread: never while the arm's thread
    builds its model, even when the loop published nothing and there is no measurement to wait for
    first; then while the arm trains (its training waits for it here, so a check after it fails). The
    arm trains as many steps as the loop's Trainer took, also when a gate rolled the loop back to an
    older version (12 of 16 steps, v12 serving at the end)."""
    from services.demo.tools_demo import _final_and_arms

    demo = _ArmDemo()
    out = asyncio.run(_final_and_arms(demo, {}, COLD, final_version, loop_steps, beside=demo.beside))
    events = demo.events
    assert events.index("arm built") < events.index("release check") < events.index("arm trained")
    assert events.index("arm trained") < events.index("measured control: demonstrations only")
    assert ("measured after online loop" in events) == (final_version > COLD.version)
    assert f"calculator-sft-only serves v{COLD.version + loop_steps}" in events
    assert out.control.label == "control: demonstrations only"


def test_without_a_control_arm_the_release_check_follows_the_last_measurement():
    from services.demo.tools_demo import _final_and_arms

    demo = _ArmDemo(control=False)
    out = asyncio.run(_final_and_arms(demo, {}, COLD, 16, 12, beside=demo.beside))
    assert demo.events == ["measured after online loop", "release check"] and out.control is None


def test_an_arm_that_fails_raises_its_own_error_with_no_release_check_first():
    from services.demo.tools_demo import _final_and_arms

    demo = _ArmDemo(broken=True)
    with pytest.raises(RuntimeError, match="no model here"):
        asyncio.run(_final_and_arms(demo, {}, COLD, 16, 12, beside=demo.beside))
    assert "release check" not in demo.events
