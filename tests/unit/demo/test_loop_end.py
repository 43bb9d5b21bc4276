"""What the demo measures at the end of its online loop (services/demo/tools_demo.py loop_end): the
version the loop ended on, unless it is the cold start's, measured already."""

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
