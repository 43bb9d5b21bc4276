"""The learning bench's report (tests/bench/learning.py), on summaries made by hand."""

from __future__ import annotations

from tests.bench.learning import pooled, report


def _summary(online, control, best=None, steps=3, curve=()):
    evals = [{"label": "after online loop", "per_prompt": online}, {"label": "control: demonstrations only", "per_prompt": control}]
    if best is not None:
        evals.append({"label": "demonstrations only, best (8 steps)", "per_prompt": best})
    return {"evals": evals, "trainer_steps": steps, "curves": {"demonstrations only (validation)": list(curve)} if curve else {}}


def test_pooled_difference_is_the_mean_over_every_problem_of_every_run():
    g, lo, hi = pooled([([0, 0, 1, 1], [1, 1, 1, 1]), ([1, 1], [1, 1])])
    assert g == 2 / 6 and lo <= g <= hi
    assert pooled([([0, 1], [0, 1])]) == (0.0, 0.0, 0.0)


def test_the_headline_compares_each_setting_with_the_first_settings_best_demonstrations_only_version():
    results = {
        (0, "base"): _summary([1, 0, 0, 0], [0, 0, 0, 0], best=[1, 1, 0, 0],
                              curve=[{"steps": 0, "validation": 0.1}, {"steps": 4, "validation": 0.3}]),
        (0, "levers"): _summary([1, 1, 1, 0], [0, 0, 0, 0]),
    }
    text = report(results, [0], ["base", "levers"])
    assert "seed 0: demonstrations only, validation success by steps after the cold start: 0: 0.10, 4: 0.30; best on held-out 0.50" in text
    assert "base               seed 0: online 0.25, control 0.00, traffic gave +0.25" in text
    assert "over best -0.25" in text.splitlines()[3]  # base: 0.25 online against 0.50
    levers = [line for line in text.splitlines() if line.startswith("  levers")]
    assert "over best +0.25" in levers[0] and "over the demonstrations' best (1 seeds) +0.25" in levers[1]
    assert "online loop, levers - base: +0.50" in text


def test_without_the_plateau_arm_only_the_equal_step_figures():
    text = report({(1, "base"): _summary([1, 1], [0, 1])}, [1], ["base"])
    assert "over best" not in text and "traffic gave +0.50" in text
