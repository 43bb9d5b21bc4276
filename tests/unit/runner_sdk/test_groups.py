"""AdaptiveRepeat: how many runs a task gets as its rewards come in, worked by hand, and run_group's stages."""

from __future__ import annotations

import asyncio

import pytest

from runner_sdk import AdaptiveRepeat
from runner_sdk.groups import run_group


def test_more_runs_by_hand():
    r = AdaptiveRepeat(first=4, full=8, failed=16)
    assert r.more([]) == 4 and r.more([1, 0]) == 2  # the first runs come first, whatever they scored
    assert r.more([1, 1, 1, 1]) == 0  # solved by every run: a flat group, no more
    assert r.more([1, 0, 1, 1]) == 4  # they disagree: completed to 8
    assert r.more([0, 0, 0, 0]) == 4  # all failed: to 8 first
    assert r.more([0] * 8) == 8  # still all failed: to 16
    assert r.more([0] * 7 + [1]) == 0  # a success in the second stage: the group of 8 has signal
    assert r.more([0] * 16) == 0  # 16 all failed: the most a task gets
    # rewards below success that agree (a partial 0.5 each) are not solved: more tries; 0.5 and 1 disagree
    units = AdaptiveRepeat(first=2, full=4)
    assert units.more([0.5, 0.5]) == 2 and units.more([0.5, 0.5, 0.5, 0.5]) == 0 and units.more([0.5, 1.0]) == 2
    assert AdaptiveRepeat(first=2, full=4, solved=0.5).more([0.5, 0.5]) == 0


def test_fixed_is_one_stage_whatever_the_rewards():
    r = AdaptiveRepeat.fixed(8)
    assert r.more([]) == 8 and r == AdaptiveRepeat(first=8, full=8)
    assert all(r.more(rewards) == 0 for rewards in ([1] * 8, [0] * 8, [0, 1] * 4))


@pytest.mark.parametrize("kwargs, message", [
    (dict(first=0, full=4), "first must be at least 1"),
    (dict(first=5, full=4), r"full \(4\) must be at least first \(5\)"),
    (dict(first=2, full=8, failed=6), r"failed \(6\) must be at least full \(8\)"),
])
def test_inconsistent_sizes_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdaptiveRepeat(**kwargs)
    with pytest.raises(ValueError, match="repeat must be at least 1"):
        AdaptiveRepeat.fixed(0)


def _group(repeat, rewards, errors=()):
    """run_group over runs whose reward is ``rewards[i]`` (an error for run ids in ``errors``): the run ids in
    order, and the stages (runs started together, before any of them ended)."""
    events: list[tuple[str, int]] = []

    async def run(i):
        events.append(("start", i))
        await asyncio.sleep(0)
        events.append(("end", i))
        return {"id": i, "reward": rewards[i], "error": i in errors}

    runs = asyncio.run(run_group(repeat, run, reward=lambda r: r["reward"], failed=lambda r: r["error"]))
    stages: list[list[int]] = []
    for k, (what, i) in enumerate(events):
        if what == "start":
            (stages[-1].append(i) if k and events[k - 1][0] == "start" else stages.append([i]))
    return [r["id"] for r in runs], stages


def test_run_group_runs_stage_by_stage_with_consecutive_run_ids():
    r = AdaptiveRepeat(first=4, full=8, failed=16)
    assert _group(r, [1] * 16) == ([0, 1, 2, 3], [[0, 1, 2, 3]])  # solved at once
    assert _group(r, [1, 1, 1, 0] + [1] * 12) == (list(range(8)), [[0, 1, 2, 3], [4, 5, 6, 7]])  # disagreed: to 8
    # failed at 4 and at 8: to 16, in three stages
    assert _group(r, [0] * 16) == (list(range(16)), [[0, 1, 2, 3], [4, 5, 6, 7], list(range(8, 16))])
    ids, _ = _group(r, [0] * 16, errors={2})
    assert ids == [0, 1, 2, 3]  # a run that failed with an error ends the group: nothing retried
    ids, _ = _group(AdaptiveRepeat.fixed(3), [0, 1, 0])
    assert ids == [0, 1, 2]


def test_kaizen_trains_loop_section_takes_adaptive_groups_and_names_its_own_keys_in_errors():
    from services.agents.dataset import TrainLoopSection

    assert TrainLoopSection().adaptive() == AdaptiveRepeat.fixed(4)  # train.repeat's default, at once
    assert TrainLoopSection(repeat=8, first_runs=4, failed_runs=16).adaptive() == AdaptiveRepeat(first=4, full=8, failed=16)
    with pytest.raises(ValueError, match=r"train.first_runs \(5\) must be at most train.repeat \(4\)"):
        TrainLoopSection(first_runs=5)
    with pytest.raises(ValueError, match="train.failed_runs needs train.first_runs"):
        TrainLoopSection(failed_runs=8)
