"""The learning bench's report (tests/bench/learning.py), on summaries made by hand."""

from __future__ import annotations

import pytest

from services.demo import tasks
from tests.bench.learning import phrasings, pooled, report


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


def test_a_finished_run_with_the_same_overrides_is_read_back_and_one_with_others_refused_unless_fresh(tmp_path, monkeypatch, capsys):
    import json

    import tests.bench.learning as bench

    made = tmp_path / "base-seed0"
    (made / "20261126-000000").mkdir(parents=True)
    (made / "20261126-000000" / "summary.json").write_text(json.dumps(_summary([1], [0])))
    overrides = ["seed=0", *bench.SETTINGS["base"], "tools.plateau.max_steps=48"]
    (made / "bench.json").write_text(json.dumps({"overrides": overrides, "commit": "abc1234"}))
    ran = []
    def fake_run(args, **kw):  # the demo fails; git names a commit
        if args[0] == "git":
            return bench.subprocess.CompletedProcess(args, 0, stdout="def5678\n")
        ran.append(args)
        return bench.subprocess.CompletedProcess(args, 1)

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    summary = bench.run_demo(0, "base", tmp_path, ["tools.plateau.max_steps=48"])
    assert not ran and summary["commit"] == "abc1234" and summary["evals"][0]["per_prompt"] == [1]
    with pytest.raises(ValueError, match=r"base-seed0 holds a finished run made with other overrides \(only it had: "
                       r"tools.plateau.max_steps=48; only this one has: tools.plateau.max_steps=0\)"):  # refused, kept
        bench.run_demo(0, "base", tmp_path, ["tools.plateau.max_steps=0"])
    assert not ran and (made / "20261126-000000" / "summary.json").exists()
    with pytest.raises(SystemExit) as refused:  # the bench refuses before it runs anything, the clash second in its plan
        bench.main(["--seeds", "1", "0", "--settings", "base", "--plateau-steps", "0", "--loop-steps", "0", "--out", str(tmp_path)])
    assert refused.value.code == 2 and "base-seed0 holds a finished run made with other overrides" in capsys.readouterr().err
    assert not ran and (made / "20261126-000000" / "summary.json").exists()
    (made / "bench.json").rename(tmp_path / "bench.json")  # a finished run the bench did not record: refused too
    with pytest.raises(ValueError, match="base-seed0 holds a finished run this bench did not record"):
        bench.run_demo(0, "base", tmp_path, ["tools.plateau.max_steps=48"])
    (tmp_path / "bench.json").rename(made / "bench.json")
    shuffled = ["tools.plateau.max_steps=48", *reversed(bench.SETTINGS["base"]), "seed=0"]  # the same, in another order
    assert bench._finished_with_other_overrides(made, shuffled) is None
    # `corrections` as measured before tools.correct_runs corrected every wrong run: the same as correct_runs=all now
    (made / "bench.json").write_text(json.dumps({"overrides": ["seed=0", "tools.explore_temperature=null", "tools.levers=false",
                                                               "tools.words=corrections"], "commit": "abc1234"}))
    assert bench._finished_with_other_overrides(made, ["seed=0", *bench.SETTINGS["corrections"]]) is None
    # `explore-kept` and `explore-discard` as measured before flat_groups=discard (bounded) was the demo's default: the
    # flat groups they pin now (kept; set aside unbounded) are what they ran with; the bounded form is another setting
    for setting, then in (("explore-kept", ["tools.keep_best=true"]),
                          ("explore-discard", ["trainer.algorithm.grpo.flat_groups=discard"])):
        (made / "bench.json").write_text(json.dumps({"overrides": ["seed=0", "tools.levers=false", "tools.explore_temperature=1.3",
                                                                   *then], "commit": "abc1234"}))
        assert bench._finished_with_other_overrides(made, ["seed=0", *bench.SETTINGS[setting]]) is None
    assert "flat_max_set_aside=16" in bench._finished_with_other_overrides(made, ["seed=0", *bench.SETTINGS["explore-bounded"]])
    # a loop of 7 minutes as measured before the demo's loop went on to 24 versions: what `--loop-steps 0` pins now
    (made / "bench.json").write_text(json.dumps({"overrides": ["seed=0", *bench.SETTINGS["explore-bounded"]], "commit": "abc1234"}))
    assert bench._finished_with_other_overrides(made, ["seed=0", *bench.SETTINGS["explore-bounded"], "min_new_versions=0"]) is None
    assert "min_new_versions=24" in bench._finished_with_other_overrides(made, ["seed=0", *bench.SETTINGS["explore-bounded"],
                                                                              "min_new_versions=24"])
    # with the levers, flat groups kept is a setting of its own (no-flat-baseline), not what `levers` ran with
    (made / "bench.json").write_text(json.dumps({"overrides": ["seed=0", *bench.SETTINGS["levers"]], "commit": "abc1234"}))
    assert "flat_groups=keep" in bench._finished_with_other_overrides(made, ["seed=0", *bench.SETTINGS["no-flat-baseline"]])
    (made / "bench.json").write_text(json.dumps({"overrides": overrides, "commit": "abc1234"}))
    with pytest.raises(RuntimeError, match=r"kaizen demo failed \(base, seed 0\)"):  # asked for: cleared, run again
        bench.run_demo(0, "base", tmp_path, ["tools.plateau.max_steps=0"], resume=False)
    assert len(ran) == 1 and not (made / "20261126-000000").exists()


def test_a_demonstrations_run_is_every_settings_best_reference_and_no_setting_of_its_own():
    arm = {"evals": [{"label": "after online loop", "per_prompt": [0, 0]},
                     {"label": "demonstrations only, best (12 steps)", "per_prompt": [1, 0]}],
           "trainer_steps": 4, "curves": {"demonstrations only (validation)": [{"steps": 0, "validation": 0.2}]}}
    results = {(3, "base"): _summary([0, 0], [0, 0]), (3, "explore"): _summary([1, 1], [1, 0]), (3, "demonstrations"): arm}
    text = report(results, [3], ["base", "explore", "demonstrations"])
    assert "seed 3: demonstrations only, validation success by steps after the cold start: 0: 0.20; best on held-out 0.50" in text
    assert "over best -0.50" in next(line for line in text.splitlines() if line.startswith("  base               seed 3"))
    assert "over the demonstrations' best (1 seeds) +0.50" in next(line for line in text.splitlines() if "explore  " in line and "pooled" in line)
    assert "demonstrations " not in "".join(line[:21] for line in text.splitlines())  # no loop line of its own
    assert "online loop, explore - base: +1.00" in text and "demonstrations - base" not in text


def test_the_curves_are_plotted_one_panel_a_seed(tmp_path):
    from tests.bench.learning import plot

    def run(online, control=None, curve=(), best=None):
        evals = [{"label": "after cold start", "version": 4, "per_prompt": [0, 0]},
                 {"label": "after online loop", "version": 17, "per_prompt": online}]
        if control is not None:
            evals.append({"label": "control: demonstrations only", "version": 17, "per_prompt": control})
        if best is not None:
            evals.append({"label": "demonstrations only, best (8 steps)", "version": 12, "per_prompt": best})
        return {"evals": evals, "curves": {"demonstrations only (validation)": list(curve)} if curve else {}}

    curve = [{"steps": 0, "validation": 0.1}, {"steps": 8, "validation": 0.5}]
    results = {(s, "explore"): run([1, 0], [0, 0]) for s in (3, 4)}
    # seed 3's loop kept its best on validation (tools.keep_best): its validation curve and the kept version, plotted too
    results[3, "explore"]["evals"].append({"label": "online loop, best on validation (8 steps)", "version": 12, "per_prompt": [1, 1]})
    results[3, "explore"]["curves"]["online loop (validation)"] = [{"steps": 0, "validation": 0.1}, {"steps": 8, "validation": 0.6}]
    results.update({(s, "demonstrations"): run([0, 0], curve=curve, best=[1, 1]) for s in (3, 4)})
    plot(results, [3, 4], ["explore", "demonstrations"], tmp_path / "learning.png")
    assert (tmp_path / "learning.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_kept_record_is_read_back_as_the_run_and_replaced_by_a_later_one(tmp_path, monkeypatch):
    import json

    import tests.bench.learning as bench

    monkeypatch.setattr(bench.subprocess, "run", lambda args, **kw: pytest.fail(f"ran {args}"))

    out, keep = tmp_path / "out", tmp_path / "keep"
    overrides = ["seed=0", *bench.SETTINGS["base"]]
    for stamp, online, commit in (("20261126-000000", [0, 1], "abc1234"), ("20261127-000000", [1, 1], "def5678")):
        run = out / "base-seed0"
        if run.exists():
            bench.shutil.rmtree(run)  # --fresh: the run folder is made again
        (run / stamp).mkdir(parents=True)
        (run / stamp / "summary.json").write_text(json.dumps(_summary(online, [0, 0])))
        (run / "buffer.db").write_text("not kept")
        (run / "bench.json").write_text(json.dumps({"overrides": overrides, "commit": commit}))
        bench.keep_record(run, keep)
    kept = sorted(str(p.relative_to(keep)) for p in keep.rglob("*") if p.is_file())
    assert kept == ["base-seed0/20261127-000000/summary.json", "base-seed0/bench.json"]  # the later run's alone
    summary = bench.run_demo(0, "base", keep, [])  # read back, nothing run
    assert summary["commit"] == "def5678" and summary["evals"][0]["per_prompt"] == [1, 1]


def test_a_loop_that_kept_its_best_is_reported_beside_its_last_version():
    kept = _summary([1, 0, 0, 0], [0, 0, 0, 0])
    kept["evals"] = [{"label": "after online loop", "version": 17, "per_prompt": [1, 0, 0, 0]},
                     {"label": "control: demonstrations only", "version": 17, "per_prompt": [0, 0, 0, 0]},
                     {"label": "demonstrations only, best (8 steps)", "version": 12, "per_prompt": [1, 1, 0, 0]},
                     {"label": "online loop, best on validation (8 steps)", "version": 12, "per_prompt": [1, 1, 1, 0]}]
    text = report({(0, "explore-kept"): kept}, [0], ["explore-kept"])
    seed, pooled_line = [line for line in text.splitlines() if line.startswith("  explore-kept")]
    assert "online 0.25" in seed and "over best -0.25" in seed and "kept 0.75 (v12, of v17), kept over best +0.25" in seed
    assert "keeping the best gave (1 seeds) +0.50" in pooled_line and "kept over the demonstrations' best (1 seeds) +0.25" in pooled_line
    text = report({(0, "explore"): _summary([1, 0], [0, 0])}, [0], ["explore"])  # no kept version: no such figure
    assert "kept" not in text


def test_each_seeds_arm_can_come_from_another_benchs_runs(tmp_path, monkeypatch, capsys):
    import json

    import tests.bench.learning as bench

    other = tmp_path / "other"
    for name, best in (("base-units-seed7", [0, 0, 0, 0]), ("explore-kept-seed7", [1, 1, 0, 0]), ("explore-seed8", None),
                       ("explore-seed9", [1, 0, 0, 0]), ("demonstrations-seed9", [1, 1, 1, 0])):
        d = other / name / "20261128-000000"
        d.mkdir(parents=True)
        d.joinpath("summary.json").write_text(json.dumps(_summary([0, 0, 0, 0], [0, 0, 0, 0], best=best)))
    arms = bench.arms_from(other, [7, 9], "calculator")  # seed 7's units run, first by name, is another task's: not it
    assert arms[7][0] == other / "explore-kept-seed7" and bench._evals(arms[7][1])[bench.BEST] == [1, 1, 0, 0]
    assert arms[9][0] == other / "demonstrations-seed9"  # the seed's demonstrations run before any other
    assert bench._evals(bench.arms_from(other, [7], "units")[7][1])[bench.BEST] == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="no finished calculator run of seed 8 with a demonstrations-only arm"):
        bench.arms_from(other, [8], "calculator")  # seed 8's run trained no arm
    text = report({(7, "explore-kept"): _summary([1, 1, 1, 0], [0, 0, 0, 0])}, [7], ["explore-kept"], arms={7: arms[7][1]})
    assert "over the demonstrations' best (1 seeds) +0.25" in text
    with pytest.raises(ValueError, match="4 problems against 2"):  # an arm of other held-out problems is not paired
        report({(7, "explore-kept"): _summary([1, 1], [0, 0])}, [7], ["explore-kept"], arms={7: arms[7][1]})
    monkeypatch.setattr(bench, "run_demo", lambda *a, **k: pytest.fail("nothing may run"))
    for args, why in ((["--seeds", "8", "--settings", "explore"], "no finished calculator run of seed 8"),
                      (["--seeds", "7", "--settings", "explore", "--plateau-steps", "48"], "no --plateau-steps here"),
                      (["--seeds", "7", "--settings", "explore", "demonstrations"], "drop the demonstrations"),
                      # the run it would make (or keep) is the one it reads its arm from
                      (["--seeds", "7", "--settings", "explore-kept", "--keep", str(other)], "explore-kept-seed7, which a run here")):
        with pytest.raises(SystemExit):
            bench.main([*args, "--arms-from", str(other), "--out", str(tmp_path / "out")])
        assert why in capsys.readouterr().err


def test_phrasings_pool_held_out_success_by_phrasing_over_seeds():
    task = tasks.get("calculator")
    # seed 3's first four held-out problems (+, /, /, /) and seed 4's first two (+, *), as their splits draw them
    assert [(p.template, task.operation(p)) for p in task.split(3, 0, 4).heldout] == [(7, "+"), (15, "/"), (17, "/"), (15, "/")]
    assert [(p.template, task.operation(p)) for p in task.split(4, 0, 2).heldout] == [(7, "+"), (2, "*")]
    only = ["tools.demonstrated_operations=*+"]  # the runs' overrides say which phrasings their demonstrations showed
    results = {(3, "s"): {**_summary([1, 0, 1, 1], [0, 0, 0, 1], best=[1, 1, 0, 1]), "overrides": ["seed=3", *only]},
               (4, "s"): {**_summary([0, 1], [1, 1]), "overrides": ["seed=4", *only]}}
    lines = phrasings(results, [3, 4], "s", arms={3: results[3, "s"]})
    assert lines == [
        "  s by phrasing, held-out success pooled over 2 seed(s) (* the demonstrations show it):",
        "    *  2  (  1 problems) online loop 1.00, control 1.00: Each of {b} rooms has {a} {x}. How many {x} are there in all",
        "    +  7  (  2 problems) online loop 0.50, control 0.50, best 1.00: {n} counted {a} {x} in one room and {b} in another. How many",
        "    / 15  (  2 problems) online loop 0.50, control 0.50, best 1.00: {a} {x} are shared equally by {b} friends. How many {x} does",
        "    / 17  (  1 problems) online loop 1.00, control 0.00, best 0.00: {b} kids split {a} {x} evenly. How many {x} does each kid ge",
        lines[-1],
    ]
    # the kinds no demonstration shows (- and /: seed 3's three / problems; seed 4 drew none), paired by problem
    assert lines[-1].startswith("    kinds no demonstration shows (3 problems, 1 seed(s)): online loop 0.67, control 0.33, traffic gave +0.33 [")
    # an arm whose demonstrations showed every kind is no "best" for runs shown * and + alone
    assert "best" not in "".join(phrasings(results, [3, 4], "s", arms={3: {**results[3, "s"], "overrides": []}}))
    for run in results.values():
        run["overrides"] = []
    every = phrasings(results, [3, 4], "s")  # every kind shown, phrasings 15 among them (not 2, 7 or 17)
    assert not any("no demonstration shows" in x for x in every)
    assert [x[4:9] for x in every[1:]] == ["*  2 ", "+  7 ", "/ 15*", "/ 17 "]


def test_a_run_whose_demonstrations_show_other_kinds_is_not_set_against_the_arms_best():
    results = {(0, "base"): _summary([1, 0], [0, 0], best=[1, 1]),
               (0, "ops"): {**_summary([1, 1], [0, 0]), "overrides": ["seed=0", "tools.demonstrated_operations=*+"]}}
    text = report(results, [0], ["base", "ops"])
    base, ops = [line for line in text.splitlines() if " seed 0: online" in line]
    assert "over best -0.50" in base and "over best" not in ops.replace("no over best", "")
    assert "no over best (its demonstrations show other kinds than the arm's)" in ops
