"""When the demonstrations-only arm stops improving (services/demo/demonstrations_only.py), worked by hand."""

from __future__ import annotations

import pytest

from services.demo.demonstrations_only import Plateau


def test_patience_counts_measurements_since_the_best():
    p = Plateau(patience=2)
    assert p.add(0, 0.10)  # best so far
    assert p.add(4, 0.30)  # better: the count restarts
    assert p.add(8, 0.25)  # one without a better score
    assert not p.add(12, 0.30)  # as good is not better: the second without, so it ends
    assert p.since_best == 2 and p.best == (4, 0.30)  # the earliest of the equal best scores


def test_a_better_score_keeps_it_going():
    p = Plateau(patience=1)
    assert p.add(0, 0.5)
    assert not p.add(4, 0.4)
    q = Plateau(patience=1)
    assert q.add(0, 0.5) and q.add(4, 0.6) and q.best == (4, 0.6)


def test_no_best_before_a_measurement():
    with pytest.raises(ValueError, match="no measurement"):
        _ = Plateau(patience=2).best


class _Demo:
    """What _final_and_arms reads of a ToolsDemo with no control arm and no plateau search."""

    def __init__(self):
        from types import SimpleNamespace

        self.t = SimpleNamespace(control=False, plateau=SimpleNamespace(max_steps=0, every=4, patience=2))
        self.measured: list[int] = []

    async def evaluate(self, label, version, agent=None, problems=None):
        from services.demo.loop import EvalResult

        self.measured.append(version)
        return EvalResult(label, version, 0.5, 0.3, 0.7, [1.0, 0.0])


@pytest.mark.parametrize("final_version", [4, 7])
def test_a_loop_that_published_nothing_reuses_the_cold_starts_measurement(final_version):
    """The version a loop ends on is measured on the held-out problems unless it is the cold start's,
    measured already (a demonstrations run's one-second loop): then that measurement stands for it."""
    import asyncio

    from services.demo.loop import EvalResult
    from services.demo.tools_demo import _final_and_arms

    demo, cold = _Demo(), EvalResult("after cold start", 4, 0.25, 0.1, 0.5, [0.0, 1.0, 0.0, 0.0], 9.0)
    arms = asyncio.run(_final_and_arms(demo, {}, cold, final_version))
    assert arms.final.label == "after online loop" and arms.final.version == final_version
    if final_version == cold.version:
        assert demo.measured == [] and arms.final.per_prompt == cold.per_prompt and arms.final.mean == cold.mean
    else:
        assert demo.measured == [final_version] and arms.final.per_prompt == [1.0, 0.0]
