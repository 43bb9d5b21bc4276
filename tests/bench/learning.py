"""`make bench` section learning (also alone: `python -m tests.bench.learning [--seeds 3 4 5 6] [--settings ...]`):
what the agent's own traffic gives, pooled over seeds, for each trainer setting of the real demo.
With no argument it makes the README's headline: seeds 3-6, `base explore demonstrations`, 12 new
versions a loop (about 2.6 hours on a 2-core AMD EPYC with AVX-512 BF16).

Each (seed, setting) is one `kaizen demo` run (SmolLM2-135M-Instruct with the calculator tool, about
22 minutes on a 2-core AVX2 host): its online loop, and its control arm trained for as many steps on
the demonstrations alone, are measured on the same held-out problems (the split depends on the seed
alone). The first setting's run of each seed also trains the demonstrations-only arm on until it
stops improving on validation problems (`tools.plateau`, about 15 more minutes) and measures its best
version: what the demonstrations alone can reach, whatever the steps. Printed per run and pooled over
seeds, each with a 95% interval from a bootstrap over the held-out problems stratified by seed:
  - over best (the headline): the online loop minus the seed's best demonstrations-only version;
  - traffic gave: the online loop minus its control arm (the equal-step figure);
  - each setting against the first: the online loops' paired difference on the same problems.
`--loop-steps N` (12 by default) makes each online loop run until its traffic was served by N new versions
(about N Trainer steps) instead of a duration, so slow and fast hosts compare the same steps;
0 runs 7 minutes (the default before 2026-11-27: the older commands in docs/DEMO.md; `make demo`'s own loop
goes on after its 7 minutes until 24 versions, at most 11.5 minutes, since 2026-11-30).
Settings are the demo overrides below: `base` is plain GRPO with the demonstrations replayed every
step, `levers` turns on the Trainer's levers (services/demo/tools_demo.py LEVERS), and each
`no-*` setting is `levers` with one lever off (the ablation), `self-imitation` is `base` with that one lever
on; `hints` and `corrections` are `base` with the simulated
users' words after a wrong answer (`tools.words`; `corrections` corrects every wrong run, as it was
measured: `tools.correct_runs=all`), to compare with `base` (rewards alone), and
`hints-centred` is `hints` with the distillation advantage centred per call (`hint_baseline=call`);
`explore` is `base` with the traffic sampled at temperature 1.3 (`tools.explore_temperature`, the
demo's default since it paid over seeds 3-6), the evaluations still at 1, and `explore-hints` is `explore`
with hints, the per-token distillation term at a fifth (`tools.hint_coef=0.2`) and centred per call (the
top-16 term at its default weight), `explore-hints-light` the same with the top-16 term at a fifth too,
`explore-hints-token` the per-token term at full weight (centred) with the top-16 term at a fifth,
`explore-hints-tool` the same with the hint on the tool call alone (`tools.hint_calls=tool`), `explore-ops`
is `explore` with demonstrations of * and + only (the report pools the kinds no demonstration shows),
`explore-wide` is `explore` with four problems a Trainer step instead of two,
`explore-kept` is `explore` whose loop also keeps its best version (`tools.keep_best`: its versions measured on
the validation problems every 4 steps and at its end, the best measured on the held-out ones; the report adds
"kept" and "kept over best" beside the loop's last version), `explore-decay` is `explore` with the learning rate
falling to a tenth over the first 28 Trainer steps (`trainer.optim.decay_steps`), `explore-corrections` is
`explore` with the users' corrections of wrong first calls (of the run each user was served), and
`explore-pipelined` is `explore-kept` with a backlog of two rounds, so traffic is sampled while the Trainer
trains (`tools.traffic.max_backlog=64`), and `explore-kl` is `explore` with a KL penalty of 0.02 to the cold start's
policy (`trainer.algorithm.kl_reference=cold_start`; `explore-kl-strong` at 0.1), and `explore-discard` is `explore` with
the groups whose runs all scored alike set aside and each step filled with groups that carry signal (DAPO's dynamic
sampling, `trainer.algorithm.grpo.flat_groups=discard`), and `explore-bounded` is `explore-discard` with at most 16
flat groups set aside between two steps (`flat_max_set_aside=16`; the settings without the levers pin the flat groups
kept, as they ran); the other settings
sample the traffic at 1, as they were measured.
`--arms-from DIR` takes each seed's demonstrations-only arm from its finished run in DIR (another bench's
`--out`, or kept records: the held-out problems depend on the seed and task alone), so a longer loop on
seeds already run need not train that arm again.
`--task units` runs every setting on the second task (`tools.task=units`: a unit converter, a reward of
1, 0.5 or 0; its runs are named `<setting>-units-seed<N>`).
`demonstrations` is no setting of the loop: a run whose online loop lasts a second and whose
demonstrations-only arm trains to its plateau (`--plateau-steps`, 48 if 0), for seeds whose first
setting ran without it (about 10 minutes a seed; its loop usually publishes nothing, and then the
cold start's measurement stands for the loop's end). Its best version is then the seed's "over best"
reference for every setting, on the same held-out problems (they depend on the seed alone).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from services.common.config import parse_overrides
from services.demo import tasks

REPO = Path(__file__).resolve().parents[2]

# flat groups kept (the Trainer's default, and the demo's before 2026-11-30), pinned in the settings without the levers that ran with them,
# so a later default cannot change what they mean (stripped by _plain when comparing with records made before the pin)
KEEP_FLAT = "trainer.algorithm.grpo.flat_groups=keep"
EXPLORE = ["tools.levers=false", "tools.explore_temperature=1.3", KEEP_FLAT]
DISCARD = "trainer.algorithm.grpo.flat_groups=discard"
# the demo's defaults before 2026-12-01 (the calculator's loop served every version at once, from a cold start of 4
# steps; its gate's rule non_inferiority, against the version last measured), pinned under every setting so that each
# means what it meant when it ran (a setting's own overrides come after them and win); stripped by _plain when
# comparing with the records made before the pin. `explore-gated-best-cold8` is `make demo`'s default since then.
PINNED = ["tools.gate_every=0", "trainer.algorithm.cold_start_steps=4", "tools.gate_rule=non_inferiority",
          "tools.gate_against=last"]
HINTS_AT_A_FIFTH = ["tools.words=hints", "tools.hint_coef=0.2", "trainer.algorithm.grpo.hint_baseline=call"]
# demo overrides of each setting (dotted keys of configs/demo.yaml; trainer.* reach the Trainer's config)
SETTINGS: dict[str, list[str]] = {
    "base": ["tools.explore_temperature=null", "tools.levers=false", KEEP_FLAT],  # plain GRPO, the demonstrations replayed every step
    "levers": ["tools.explore_temperature=null", "tools.levers=true"],  # services/demo/tools_demo.py LEVERS
    "no-self-imitation": ["tools.explore_temperature=null", "tools.levers=true", "trainer.algorithm.self_imitation.coef=0"],
    "no-flat-baseline": ["tools.explore_temperature=null", "tools.levers=true", "trainer.algorithm.grpo.flat_groups=keep"],
    "no-demo-schedule": ["tools.explore_temperature=null", "tools.levers=true", "trainer.algorithm.sft_coef_final=null",
                         "trainer.algorithm.demo_replay=every_step"],
    "no-importance": ["tools.explore_temperature=null", "tools.levers=true", "trainer.algorithm.grpo.importance=off"],
    # `base` plus one lever: the agent's own successes replayed beside the demonstrations (which stay every step)
    "self-imitation": ["tools.explore_temperature=null", "tools.levers=false", KEEP_FLAT, "trainer.algorithm.self_imitation.coef=1.0",
                       "trainer.algorithm.self_imitation.ramp_steps=4", "trainer.algorithm.self_imitation.batch_size=8",
                       "trainer.algorithm.self_imitation.per_task=1"],
    # feedback in words on wrong answers, beside the rewards (issue 30): against `base`, rewards alone
    "hints": ["tools.explore_temperature=null", "tools.levers=false", KEEP_FLAT, "tools.words=hints"],
    # hints with the distillation advantage centred per call (algorithm.grpo.hint_baseline=call)
    "hints-centred": ["tools.explore_temperature=null", "tools.levers=false", KEEP_FLAT, "tools.words=hints", "trainer.algorithm.grpo.hint_baseline=call"],
    # every wrong run corrected, as measured (tools.correct_runs=all)
    "corrections": ["tools.explore_temperature=null", "tools.levers=false", KEEP_FLAT, "tools.words=corrections", "tools.correct_runs=all"],
    # `base` with the traffic sampled hotter than the evaluations (exploration runs; the Trainer scores them at 1.3)
    "explore": EXPLORE,
    # hints on the demo's traffic at 1.3: the per-token distillation term at a fifth, centred per call; the top-16 term
    # (top_k_coef) at its default, 1 (against `explore`)
    "explore-hints": [*EXPLORE, *HINTS_AT_A_FIFTH],
    # the same with the top-16 term at a fifth too: the whole hint signal a fifth of explore-hints'
    "explore-hints-light": [*EXPLORE, *HINTS_AT_A_FIFTH, "trainer.algorithm.grpo.top_k_coef=0.2"],
    # the per-token distillation term at full weight (centred per call), the top-16 term kept at a fifth
    "explore-hints-token": [*EXPLORE, "tools.words=hints", "tools.hint_coef=1.0", "trainer.algorithm.grpo.hint_baseline=call",
                            "trainer.algorithm.grpo.top_k_coef=0.2"],
    # the same, the hint given to the tool call alone (the first call, when it was wrong), never to the answer call
    "explore-hints-tool": [*EXPLORE, "tools.words=hints", "tools.hint_coef=1.0", "tools.hint_calls=tool",
                           "trainer.algorithm.grpo.hint_baseline=call", "trainer.algorithm.grpo.top_k_coef=0.2"],
    # the same, no distillation on a hinted call's first token (the call-or-words choice, left to the reward): by mid-loop
    # the agent reading a hint hardly ever opens the call but still prefers the right call's arguments (hint_signal.py)
    "explore-hints-skip": [*EXPLORE, "tools.words=hints", "tools.hint_coef=1.0", "tools.hint_calls=tool",
                           "trainer.algorithm.grpo.hint_baseline=call", "trainer.algorithm.grpo.top_k_coef=0.2",
                           "trainer.algorithm.grpo.hint_skip_first=1"],
    # the demonstrations show * and + only: - and / are learnt from the traffic alone (issue 29's "what no demonstration showed")
    "explore-ops": [*EXPLORE, "tools.demonstrated_operations=*+"],
    # four problems a step, not two (64 calls a batch, the backlog as large): at --loop-steps 12 as many episodes as
    # `explore` at 24, in about the same time
    "explore-wide": [*EXPLORE, "tools.traffic.tasks_per_batch=4", "tools.traffic.max_backlog=64"],
    # `explore` whose online loop keeps its best version, chosen on the validation problems (tools.keep_best): the same
    # training, so each run gives explore's last version too
    "explore-kept": [*EXPLORE, "tools.keep_best=true"],
    # `explore` whose learning rate falls (cosine) to a tenth over the Trainer's first 28 steps (the cold start's 4 and
    # a 24-version loop), then stays there: against the operator drift of the loop's late versions
    "explore-decay": [*EXPLORE, "trainer.optim.decay_steps=28"],
    # `explore` with the simulated users' corrections (a wrong episode's first call, as it should have been, posted as a
    # new demonstration) of the run each was served: the one signal that reaches a phrasing every run gets wrong (an
    # all-wrong group teaches nothing)
    "explore-corrections": [*EXPLORE, "tools.words=corrections"],
    # `explore` whose flat groups train against a fixed baseline of 0.5 (trainer.algorithm.grpo.flat_groups=baseline): a
    # group whose 8 runs all used the wrong operator pushes it down, one whose runs were all right pushes the right one up;
    # today both teach nothing, which leaves the late versions' operators free to drift
    "explore-flat": [*EXPLORE, "trainer.algorithm.grpo.flat_groups=baseline"],
    # `explore-kept` whose traffic runs while the Trainer trains: a backlog of two rounds (64 calls), not one, so the next
    # round is sampled (by the version before) during each step instead of after it (issue 31: Trainer steps a minute)
    "explore-pipelined": [*EXPLORE, "tools.keep_best=true", "tools.traffic.max_backlog=64"],
    # `explore` with the agent's own past successes rehearsed in every step (self-imitation at half weight, ramped over 4
    # steps: 8 calls a step, the best run of each solved problem, taken in turn from the newest 512): against the late
    # versions' operator drift, a step whose one signal is a multiplication group meets the past additions it would undo
    "explore-rehearse": [*EXPLORE, "trainer.algorithm.self_imitation.coef=0.5", "trainer.algorithm.self_imitation.ramp_steps=4",
                         "trainer.algorithm.self_imitation.batch_size=8", "trainer.algorithm.self_imitation.per_task=1"],
    # `explore` whose group-centred rewards are not divided by the group's std (Dr. GRPO: trainer.algorithm.grpo.std_normalize
    # =false): a group of 7 right runs and 1 wrong then weighs 0.44 of one of 4 and 4 (their summed |advantage|), against
    # 0.66 scaled by the std; against the late versions' drift, which comes when most informative groups are nearly solved
    "explore-drgrpo": [*EXPLORE, "trainer.algorithm.grpo.std_normalize=false"],
    # `explore` whose traffic rewards credit the tool call (tools.call_credit=0.2): a wrong answer after a call that computed
    # the answer scores 0.2, after a call with the problem's operator 0.1. Against the late versions' operator drift: a
    # group whose 8 runs all answered wrong (the "kids split" phrasing in every run) today teaches nothing, and with the
    # credit it tells the right operator from a wrong one; in a group with a success a credited run stays near its mean
    "explore-credit": [*EXPLORE, "tools.call_credit=0.2"],
    # `explore` with a KL penalty (0.02) to the cold start's policy (trainer.algorithm.kl_reference=cold_start), RLHF's anchor
    # to its supervised policy: against the late versions' operator drift on the phrasings the demonstrations show (0.88-1.00
    # in the control, 0.62-0.80 in the loop). At 0.1 (`explore-kl-strong`) seed 7's traffic rewards trailed explore-kept's
    # by half through 18 versions: k3 pulls hard on a token the cold start liked and the policy learnt to avoid, and on the
    # phrasings no demonstration shows that is the wrong operator the traffic is unlearning
    "explore-kl": [*EXPLORE, "trainer.algorithm.kl_coef=0.02", "trainer.algorithm.kl_reference=cold_start"],
    "explore-kl-strong": [*EXPLORE, "trainer.algorithm.kl_coef=0.1", "trainer.algorithm.kl_reference=cold_start"],
    # `explore` with DAPO's dynamic sampling (trainer.algorithm.grpo.flat_groups=discard): a group whose 8 runs all scored alike
    # is set aside and the step waits for two groups that carry signal, so every version trains on two informative groups
    # (the demo's steps had 0-3, 40 % of its groups flat) at the cost of more traffic a version; the control arm still gets
    # as many steps
    "explore-discard": [*EXPLORE, DISCARD, "trainer.algorithm.grpo.flat_max_set_aside=0"],
    # `explore-discard` bounded: at most 16 flat groups (8 rounds) set aside between two steps, then they are kept, so a
    # cold start that rarely succeeds still steps and replays its demonstrations (seed 11 starved 240 s unbounded)
    "explore-bounded": [*EXPLORE, DISCARD, "trainer.algorithm.grpo.flat_max_set_aside=16"],
    # `explore-bounded` whose versions go through the Explorer's release gate in the loop (tools.gate_every=4): every 4th
    # version is measured greedily on the gate's 32 problems against the one the gate last measured, and a worse one rolls
    # the loop back to it (the Trainer continues from its state): against the late versions' drift (seeds 16 and 18)
    "explore-gated": [*EXPLORE, DISCARD, "trainer.algorithm.grpo.flat_max_set_aside=16", "tools.gate_every=4"],
    "explore-gated-no-harm": [*EXPLORE, DISCARD, "trainer.algorithm.grpo.flat_max_set_aside=16", "tools.gate_every=4",
                              "tools.gate_rule=no_harm"],
    # the same, each measured version against the best the gate has measured, a rejection rolling back to it
    "explore-gated-best": [*EXPLORE, DISCARD, "trainer.algorithm.grpo.flat_max_set_aside=16", "tools.gate_every=4",
                           "tools.gate_rule=no_harm", "tools.gate_against=best"],
    # the same from a cold start of 8 supervised steps instead of 4: the first versions' traffic, sampled at 1.3 from a
    # cold start that solves a tenth of the problems, scored all wrong for the loop's first 100-150 s (their groups set
    # aside, a step every 40-90 s); 4 more steps on the demonstrations took the validation problems from 0.05-0.28 to
    # 0.30-0.53 in every seed's demonstrations-only arm. The plateau arm is unchanged by it (it starts at step 0 and
    # measures every 4), so --arms-from records made with a cold start of 4 stay the fair control
    "explore-gated-best-cold8": [*EXPLORE, DISCARD, "trainer.algorithm.grpo.flat_max_set_aside=16", "tools.gate_every=4",
                                 "tools.gate_rule=no_harm", "tools.gate_against=best", "trainer.algorithm.cold_start_steps=8"],
    # the same whose learning rate falls (cosine) from 1e-3 to a tenth over the Trainer's 32 steps (the cold start's 8 and
    # a 24-version loop), the equal-step control arm with it: against the late versions' drift that the gate rolls back
    # (seeds 24-25 ended on v24, their v32 rejected; the gate's mean over seven seeds 0.86 at v24, 0.83 at v32). Chosen
    # before any run, the schedule `explore-decay` measured ungated (+0.03 [-0.03, +0.08] over its constant rate)
    "explore-gated-best-cold8-decay": [*EXPLORE, DISCARD, "trainer.algorithm.grpo.flat_max_set_aside=16", "tools.gate_every=4",
                                       "tools.gate_rule=no_harm", "tools.gate_against=best",
                                       "trainer.algorithm.cold_start_steps=8", "trainer.optim.decay_steps=32"],
    # the default whose traffic runs a problem in stages (traffic.first_runs, runner_sdk/groups.py): 4 runs first, 8 where
    # they disagree or all failed, 16 where all 8 failed; 4 problems a round so that the first stage keeps the engine's
    # batch of 16 (the Trainer's step stays 32 calls: a round's first runs). Against the late loop's rounds that mostly
    # buy flat groups, and the phrasings whose right call sampling finds once in 8-40 tries (docs/DEMO.md)
    "explore-gated-best-cold8-adaptive": [*EXPLORE, DISCARD, "trainer.algorithm.grpo.flat_max_set_aside=16", "tools.gate_every=4",
                                          "tools.gate_rule=no_harm", "tools.gate_against=best", "trainer.algorithm.cold_start_steps=8",
                                          "tools.traffic.tasks_per_batch=4", "tools.traffic.first_runs=4",
                                          "tools.traffic.failed_runs=16"],
    # the same without the 16: in seed 24's run (22249b3) 21 problems went to 16 runs and 2 of them found a success
    # (19 were "kids split"), 168 episodes for 2 groups with signal, while stopping the solved at 4 saved 372; its
    # loop took 647 s against the default's 494. So: 4 runs first, 8 where they disagree or all failed
    "explore-gated-best-cold8-adaptive8": [*EXPLORE, DISCARD, "trainer.algorithm.grpo.flat_max_set_aside=16", "tools.gate_every=4",
                                           "tools.gate_rule=no_harm", "tools.gate_against=best", "trainer.algorithm.cold_start_steps=8",
                                           "tools.traffic.tasks_per_batch=4", "tools.traffic.first_runs=4"],
    # the default with the simulated users' corrections of the answer they were served (tools.words=corrections): under
    # the ungated loop of 2026-11-28 they solved the phrasings no run solved ("{b} kids split" 0.79) and moved their
    # neighbours' operators (+0.00 [-0.04, +0.05] over rewards alone, seeds 7-14); a gate measured against its best
    # version now rolls back a version that lost those
    "explore-gated-best-cold8-corrections": [*EXPLORE, DISCARD, "trainer.algorithm.grpo.flat_max_set_aside=16",
                                             "tools.gate_every=4", "tools.gate_rule=no_harm", "tools.gate_against=best",
                                             "trainer.algorithm.cold_start_steps=8", "tools.words=corrections"],
    # no online loop to speak of (one round of traffic at most): the demonstrations-only arm from the cold start to its plateau
    "demonstrations": ["tools.levers=false", KEEP_FLAT, "tools.control=false", "duration_s=1", "min_new_versions=0"],
}
ARM_ONLY = "demonstrations"


BEST = "demonstrations only, best"  # the label of the plateau arm's best version (services/demo/tools_demo.py)
KEPT = "online loop, best on validation"  # the label of the online loop's kept version (tools.keep_best), ditto


def _commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def _plain(overrides: list[str]) -> list[str]:
    """Overrides as compared for resuming: the traffic's temperature pinned to null (the demo's default
    before 1.3) and every wrong run corrected (before tools.correct_runs) are what a run made without
    them did too, and so are flat groups kept without the levers (before flat_groups=discard was the demo's
    default) and set aside unbounded (before flat_max_set_aside), and so is a loop of the demo's 7 minutes alone
    (before its loop went on to 24 versions)."""
    drop = {"tools.explore_temperature=null", "tools.correct_runs=all", "trainer.algorithm.grpo.flat_max_set_aside=0",
            "min_new_versions=0", *PINNED}
    if "tools.levers=true" not in overrides:  # the levers' flat groups were never the demo's to keep
        drop.add(KEEP_FLAT)
    return [o for o in overrides if o not in drop]


def _overrides(seed: int, setting: str, extra: list[str]) -> list[str]:
    return [f"seed={seed}", *PINNED, *SETTINGS[setting], *extra]


def _run_dir(out: Path, seed: int, setting: str, task: str) -> Path:
    return out / (f"{setting}-seed{seed}" if task == "calculator" else f"{setting}-{task}-seed{seed}")


def _finished_with_other_overrides(run_dir: Path, overrides: list[str]) -> str | None:
    """Why a finished run in ``run_dir`` may not be replaced by a run with ``overrides`` (none if it may)."""
    made = run_dir / "bench.json"
    if not list(run_dir.glob("*/summary.json")):
        return None  # none, or an unfinished one: nothing to lose
    if not made.exists():  # a demo run by hand there, or a bench stopped before it wrote what it ran
        return f"{run_dir} holds a finished run this bench did not record: choose another --out, or --fresh to run it again"
    old, new = _plain(json.loads(made.read_text())["overrides"]), _plain(overrides)
    if sorted(old) == sorted(new):
        return None
    gone, added = [o for o in old if o not in new], [o for o in new if o not in old]
    return (f"{run_dir} holds a finished run made with other overrides (only it had: {' '.join(gone) or 'none'}; "
            f"only this one has: {' '.join(added) or 'none'}): choose another --out, or --fresh to run it again")


def run_demo(seed: int, setting: str, out: Path, extra: list[str] = (), *, resume: bool = True,
             task: str = "calculator") -> dict:
    """One `kaizen demo` run; with resume, a finished run in `out` made with the same overrides is
    read back instead of run again (so a long bench can be continued later with the same --out), and
    one made with other overrides is refused, not thrown away (``resume=False`` runs it again)."""
    run_dir = _run_dir(out, seed, setting, task)
    overrides = _overrides(seed, setting, extra)
    args = [sys.executable, "-m", "services.cli", "demo", "--config", "configs/demo.yaml", f"run_dir={run_dir}", *overrides]
    log, made = run_dir.with_suffix(".log"), run_dir / "bench.json"
    done = list(run_dir.glob("*/summary.json"))
    if resume and (why := _finished_with_other_overrides(run_dir, overrides)):
        raise ValueError(why)
    if resume and done and made.exists():
        summary = json.loads(done[0].read_text())
    else:
        if run_dir.exists():
            shutil.rmtree(run_dir)  # an unfinished run, or --fresh: its parts would mix with this one's
        run_dir.mkdir(parents=True)
        commit = _commit()  # the code it starts with (a commit made while it runs is not its code)
        with open(log, "w") as f:
            r = subprocess.run(args, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
        if r.returncode != 0:
            raise RuntimeError(f"kaizen demo failed ({setting}, seed {seed}): see {log}")
        made.write_text(json.dumps({"overrides": overrides, "commit": commit}))
        summary = json.loads(next(run_dir.glob("*/summary.json")).read_text())
    summary["log"] = str(log)
    record = json.loads(made.read_text())
    summary["commit"], summary["overrides"] = record["commit"], record["overrides"]
    return summary


def keep_record(run_dir: Path, keep: Path) -> None:
    """Copies a finished run's record, all that ``report`` and ``plot`` read (bench.json and the
    demo's summary.json, a few kilobytes), to ``keep`` in the run folder's own layout: ``--out keep``
    reports it again later, without its buffer and checkpoints, and pools it with new runs."""
    summary = next(run_dir.glob("*/summary.json"))
    shutil.rmtree(keep / run_dir.name, ignore_errors=True)  # a record kept before (another run of it) goes
    dest = keep / run_dir.name / summary.parent.name
    dest.mkdir(parents=True)
    shutil.copyfile(run_dir / "bench.json", dest.parent / "bench.json")
    shutil.copyfile(summary, dest / "summary.json")


def _by_label(summary: dict) -> dict[str, dict]:
    """label -> evaluation; the plateau arm's best under BEST and the loop's kept version under KEPT, whatever their steps."""
    return {next((k for k in (BEST, KEPT) if e["label"].startswith(k)), e["label"]): e for e in summary["evals"]}


def _evals(summary: dict) -> dict[str, list[float]]:
    """label -> per-problem scores (as _by_label)."""
    return {label: e["per_prompt"] for label, e in _by_label(summary).items()}


def _demonstrated(summary: dict, task: str) -> str:
    """The kinds of problem a run's demonstrations showed: its last tools.demonstrated_operations override, else all."""
    ops = [v for k, v in parse_overrides(summary.get("overrides", [])) if k == "tools.demonstrated_operations"]
    return str(ops[-1]) if ops and ops[-1] is not None else tasks.get(task).operations


def _measure(task: str) -> str:
    """What a held-out figure is: the calculator's success, the graded units task's mean reward."""
    return "mean reward" if task == "units" else "success"


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def pooled(pairs: list[tuple[list[float], list[float]]], *, rounds: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Mean of after - before over every (run, problem), with a 95% interval from a bootstrap that
    resamples problems within each run (the runs are the strata). Paired by problem: each run's two
    lists must be as long (runs made with other held-out problems cannot be paired)."""
    if bad := [(len(b), len(a)) for b, a in pairs if len(b) != len(a)]:
        raise ValueError(f"scores of different held-out sets cannot be paired: {bad[0][0]} problems against {bad[0][1]}")
    diffs = [[a - b for b, a in zip(before, after)] for before, after in pairs]
    n = sum(len(d) for d in diffs)
    mean = sum(sum(d) for d in diffs) / n
    rng = random.Random(seed)
    means = sorted(sum(d[rng.randrange(len(d))] for d in diffs for _ in d) / n for _ in range(rounds))
    return mean, means[int(0.025 * rounds)], means[int(0.975 * rounds) - 1]


def _arms(results: dict[tuple[int, str], dict], seeds: list[int], settings: list[str],
          arms: dict[int, dict] | None) -> dict[int, dict]:
    """Each seed's run holding its plateau arm, if one ran: given (--arms-from), else the demonstrations
    run's, else the first setting's."""
    return {s: (arms or {}).get(s) or (results[s, ARM_ONLY] if ARM_ONLY in settings else results[s, settings[0]]) for s in seeds}


def arms_from(folder: Path, seeds: list[int], task: str) -> dict[int, tuple[Path, dict]]:
    """Each seed's finished run in ``folder`` (another bench's --out, or kept records) whose
    demonstrations-only arm was trained to its plateau, and its summary: the seed's "over best"
    reference (the held-out problems depend on the seed and the task alone). The seed's `demonstrations`
    run if there is one, else the first such run by name."""
    out = {}
    for seed in seeds:
        suffix = f"-seed{seed}" if task == "calculator" else f"-{task}-seed{seed}"
        runs = [d for d in sorted(folder.glob(f"*{suffix}"), key=lambda d: (not d.name.startswith(f"{ARM_ONLY}-"), d.name))
                if d.is_dir() and (task != "calculator" or "-units-" not in d.name)]
        found = [(d, json.loads(f.read_text())) for d in runs for f in d.glob("*/summary.json")]
        found = [(d, sm) for d, sm in found if BEST in _by_label(sm)]
        if not found:
            raise ValueError(f"{folder} holds no finished {task} run of seed {seed} with a demonstrations-only arm trained to "
                             "its plateau (a demonstrations run, or a first setting's run with --plateau-steps)")
        out[seed] = found[0]
    return out


def report(results: dict[tuple[int, str], dict], seeds: list[int], settings: list[str], task: str = "calculator",
           arms: dict[int, dict] | None = None) -> str:
    what = f"{'unit converter' if task == 'units' else 'calculator tool'}; held-out {_measure(task)}"
    lines = [f"learning (SmolLM2-135M-Instruct, {what}, 95% intervals)", ""]
    arm = _arms(results, seeds, settings, arms)
    best = {s: _evals(arm[s]).get(BEST) for s in seeds}
    shown = {s: _demonstrated(arm[s], task) for s in seeds}
    settings = [s for s in settings if s != ARM_ONLY]
    for seed in seeds:
        curve = arm[seed].get("curves", {}).get("demonstrations only (validation)", [])
        if curve:
            points = ", ".join(f"{p['steps']}: {p['validation']:.2f}" for p in curve)
            lines.append(f"  seed {seed}: demonstrations only, validation {_measure(task)} by steps after the cold start: {points}; "
                         f"best on held-out {_mean(best[seed]):.2f}")
    for setting in settings:
        pairs, over, kept_over, kept_gain = [], [], [], []
        for seed in seeds:
            ev, by = _evals(results[seed, setting]), _by_label(results[seed, setting])
            online, control = ev["after online loop"], ev["control: demonstrations only"]
            pairs.append((control, online))
            g, lo, hi = pooled([(control, online)])
            line = (f"  {setting:<18} seed {seed}: online {_mean(online):.2f}, control {_mean(control):.2f}, traffic gave "
                    f"{g:+.2f} [{lo:+.2f}, {hi:+.2f}], {results[seed, setting]['trainer_steps']} Trainer steps in all (code {results[seed, setting].get('commit', '?')})")
            comparable = best[seed] and _demonstrated(results[seed, setting], task) == shown[seed]
            if best[seed] and not comparable:
                line += "; no over best (its demonstrations show other kinds than the arm's)"
            elif comparable:
                over.append((best[seed], online))
                g, lo, hi = pooled([(best[seed], online)])
                line += f"; over best {g:+.2f} [{lo:+.2f}, {hi:+.2f}]"
            if KEPT in ev:  # tools.keep_best: the loop's best version on validation, beside its last
                kept = ev[KEPT]
                kept_gain.append((online, kept))
                line += f"; kept {_mean(kept):.2f} (v{by[KEPT]['version']}, of v{by['after online loop']['version']})"
                if comparable:
                    kept_over.append((best[seed], kept))
                    g, lo, hi = pooled([(best[seed], kept)])
                    line += f", kept over best {g:+.2f} [{lo:+.2f}, {hi:+.2f}]"
            lines.append(line)
        g, lo, hi = pooled(pairs)
        line = f"  {setting:<18} pooled over {len(seeds)} seeds: traffic gave {g:+.2f} [{lo:+.2f}, {hi:+.2f}]"
        if over:
            g, lo, hi = pooled(over)
            line += f"; over the demonstrations' best ({len(over)} seeds) {g:+.2f} [{lo:+.2f}, {hi:+.2f}]"
        if kept_gain:
            g, lo, hi = pooled(kept_gain)
            line += f"; keeping the best gave ({len(kept_gain)} seeds) {g:+.2f} [{lo:+.2f}, {hi:+.2f}]"
        if kept_over:
            g, lo, hi = pooled(kept_over)
            line += f"; kept over the demonstrations' best ({len(kept_over)} seeds) {g:+.2f} [{lo:+.2f}, {hi:+.2f}]"
        lines.append(line)
    first = settings[0] if settings else None
    for setting in settings[1:]:
        pairs = [(_evals(results[s, first])["after online loop"], _evals(results[s, setting])["after online loop"])
                 for s in seeds]
        g, lo, hi = pooled(pairs)
        lines.append(f"  online loop, {setting} - {first}: {g:+.2f} [{lo:+.2f}, {hi:+.2f}] (pooled, paired by problem)")
    return "\n".join(lines)


def phrasings(results: dict[tuple[int, str], dict], seeds: list[int], setting: str, task: str = "calculator",
              arms: dict[int, dict] | None = None) -> list[str]:
    """Where the online loop still fails: held-out success by phrasing, pooled over ``seeds``, for the
    loop's last version, its control and the demonstrations' best (``arms``: each seed's run holding it,
    as ``_arms`` gives; left out where its demonstrations showed other kinds than this setting's);
    ``*`` marks the phrasings this setting's demonstrations show. A seed's held-out problems are the
    first its split draws, so they follow from the seed and their number alone."""
    t = tasks.get(task)
    columns = {"online loop": "after online loop", "control": "control: demonstrations only", "best": BEST}
    scores: dict[int, dict[str, list[float]]] = {}
    shown: set[int] = set()
    unshown: list[tuple[list[float], list[float]]] = []  # (control, loop) on the kinds no demonstration shows, a pair a seed
    for seed in seeds:
        run = results[seed, setting]
        ops = _demonstrated(run, task)
        shown |= {p.template for p in t.demonstration_problems(ops)}
        ev = {label: xs for label, xs in _evals(run).items() if label != BEST}  # the best is the arm's alone
        if arms and seed in arms and _demonstrated(arms[seed], task) == ops:
            ev[BEST] = _evals(arms[seed]).get(BEST)
        heldout = t.split(seed, 0, len(ev["after online loop"])).heldout
        for name, label in columns.items():
            for p, score in zip(heldout, ev.get(label) or []):
                scores.setdefault(p.template, {}).setdefault(name, []).append(score)
        new = [i for i, p in enumerate(heldout) if t.operation(p) not in ops]
        if new:
            unshown.append(([ev[columns["control"]][i] for i in new], [ev[columns["online loop"]][i] for i in new]))
    lines = [f"  {setting} by phrasing, held-out {_measure(task)} pooled over {len(seeds)} seed(s) (* the demonstrations show it):"]
    for template in sorted(scores):
        kind, text = t.templates[template]
        figures = ", ".join(f"{name} {_mean(xs):.2f}" for name, xs in scores[template].items())
        mark = "*" if template in shown else " "
        lines.append(f"    {kind} {template:>2}{mark} ({len(scores[template]['online loop']):>3} problems) {figures}: {text[:60]}")
    if unshown:  # issue 29: the traffic must teach what no demonstration showed
        g, lo, hi = pooled(unshown)
        control, loop = [x for c, _ in unshown for x in c], [x for _, o in unshown for x in o]
        lines.append(f"    kinds no demonstration shows ({len(loop)} problems, {len(unshown)} seed(s)): online loop "
                     f"{_mean(loop):.2f}, control {_mean(control):.2f}, traffic gave {g:+.2f} [{lo:+.2f}, {hi:+.2f}] "
                     "(pooled, paired by problem)")
    return lines


def plot(results: dict[tuple[int, str], dict], seeds: list[int], settings: list[str], path: Path,
         task: str = "calculator", arms: dict[int, dict] | None = None) -> None:
    """One panel a seed, against Trainer steps after the cold start: the demonstrations-only arm's
    validation curve and its best version's held-out score, and each setting's online loop and control
    arm on the held-out problems (at the loop's steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loops = [s for s in settings if s != ARM_ONLY]
    arm_of = _arms(results, seeds, settings, arms)
    fig, axes = plt.subplots(1, len(seeds), figsize=(4.2 * len(seeds), 3.8), sharey=True, squeeze=False)
    for ax, seed in zip(axes[0], seeds):
        arm = arm_of[seed]
        by_label = _by_label(arm)
        start = by_label["after cold start"]["version"]
        curve = arm.get("curves", {}).get("demonstrations only (validation)", [])
        if curve:
            ax.plot([c["steps"] for c in curve], [c["validation"] for c in curve], "o-", color="tab:brown", ms=3,
                    label="demonstrations only (validation)")
        if BEST in by_label:
            ax.plot([by_label[BEST]["version"] - start], [_mean(by_label[BEST]["per_prompt"])], "*", color="tab:brown", ms=12,
                    label="its best (held-out)")
        for k, setting in enumerate(loops):
            ev = {e["label"]: e for e in results[seed, setting]["evals"]}
            cold, online = ev["after cold start"], ev["after online loop"]
            steps = online["version"] - cold["version"]
            color = f"C{k}"
            ax.plot([0, steps], [_mean(cold["per_prompt"]), _mean(online["per_prompt"])], "D-", color=color,
                    label=f"{setting}: online loop (held-out)")
            control = ev.get("control: demonstrations only")
            if control is not None:
                ax.plot([steps], [_mean(control["per_prompt"])], "s", color=color, mfc="none", ms=8, label=f"{setting}: its control")
            loop_curve = results[seed, setting].get("curves", {}).get("online loop (validation)", [])
            if loop_curve:  # tools.keep_best
                ax.plot([c["steps"] for c in loop_curve], [c["validation"] for c in loop_curve], ":", color=color, marker="o",
                        ms=3, label=f"{setting}: online loop (validation)")
                kept = _by_label(results[seed, setting])[KEPT]
                ax.plot([kept["version"] - cold["version"]], [_mean(kept["per_prompt"])], "*", color=color, ms=12,
                        label=f"{setting}: its best (held-out)")
        ax.set(title=f"seed {seed}", xlabel="Trainer steps after the cold start", ylim=(0, 1))
    axes[0][0].set_ylabel(f"{_measure(task)} (95% intervals: learning.txt)")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[3, 4, 5, 6])
    p.add_argument("--settings", nargs="+", default=["base", "explore", ARM_ONLY], choices=sorted(SETTINGS))
    p.add_argument("--out", type=Path, default=None,
                   help="Folder for the runs (default: a temporary one); a run already finished there with the same overrides is "
                   "reused, one with other overrides refused (--fresh runs it again).")
    p.add_argument("--fresh", action="store_true", help="Run every (seed, setting) again, even one finished in --out.")
    p.add_argument("--keep", type=Path, default=None,
                   help="Also copy each finished run's record (bench.json, summary.json) to this folder, which a later --out can "
                   "name to report those runs again, or pool them with new ones (docs/learning-runs holds the README's).")
    p.add_argument("--loop-steps", type=int, default=12,
                   help="Run each online loop until its traffic was served by this many new versions; 0: 7 minutes.")
    p.add_argument("--task", default="calculator", choices=["calculator", "units"],
                   help="The demo's task (tools.task) for every run: units is the second task, a unit converter with a graded reward.")
    p.add_argument("--arms-from", type=Path, default=None,
                   help="Take each seed's demonstrations-only arm (the \"over best\" reference) from its finished run in this "
                   "folder (another bench's --out, or kept records), made with the same task and held-out problems; no run "
                   "here trains one (--plateau-steps is 0 with it), and no run here may replace a run it reads.")
    p.add_argument("--plateau-steps", type=int, default=None,
                   help="The demonstrations-only arm's steps at most (tools.plateau.max_steps): in the demonstrations run if that "
                   "setting is given (0: 48), else in the first setting's run of each seed (0: off). Default 48, or 0 "
                   "with --arms-from.")
    a = p.parse_args(argv if argv is not None else [])
    out = a.out or Path(tempfile.mkdtemp(prefix="kaizen-learning-"))
    arms, sources = None, {}
    if a.arms_from is not None:
        if ARM_ONLY in a.settings:
            p.error(f"--arms-from takes each seed's arm from its folder: drop the {ARM_ONLY} setting")
        if a.plateau_steps:
            p.error("--arms-from takes each seed's arm from its folder: no --plateau-steps here")
        try:  # before any run: a missing reference is found now, not after hours
            found = arms_from(a.arms_from, a.seeds, a.task)
        except ValueError as e:
            p.error(str(e))
        arms = {seed: sm for seed, (_, sm) in found.items()}
        sources = {seed: d for seed, (d, _) in found.items()}
        mine = {_run_dir(root, seed, setting, a.task).resolve() for root in (out, a.keep) if root is not None
                for seed in a.seeds for setting in a.settings}
        if clash := sorted(str(d) for d in sources.values() if d.resolve() in mine):
            p.error(f"--arms-from reads {', '.join(clash)}, which a run here (--out or --keep) would replace: choose other folders")
    a.plateau_steps = 0 if a.arms_from is not None else (48 if a.plateau_steps is None else a.plateau_steps)
    # 0: the demo's 7 minutes alone (its own loop goes on to 24 versions since 2026-11-30)
    loop = [f"min_new_versions={a.loop_steps}", "duration_s=1", "max_duration_s=7200"] if a.loop_steps else ["min_new_versions=0"]
    plan = []
    for seed in a.seeds:
        for setting in a.settings:
            if setting == ARM_ONLY:
                extra = [f"tools.plateau.max_steps={a.plateau_steps or 48}"]
            else:
                first = setting == a.settings[0] and ARM_ONLY not in a.settings
                extra = loop + ([f"tools.plateau.max_steps={a.plateau_steps}"] if first and a.plateau_steps else [])
            plan.append((seed, setting, extra + ([] if a.task == "calculator" else [f"tools.task={a.task}"])))
    if not a.fresh:  # before hours of runs, not after: a finished run is never thrown away unasked
        clashes = [why for seed, setting, extra in plan
                   if (why := _finished_with_other_overrides(_run_dir(out, seed, setting, a.task),
                                                              _overrides(seed, setting, extra)))]
        if clashes:
            p.error("\n".join(clashes))
    results = {}
    for seed, setting, extra in plan:
        results[seed, setting] = run_demo(seed, setting, out, extra, resume=not a.fresh, task=a.task)
        if a.keep and a.keep.resolve() != out.resolve():
            keep_record(_run_dir(out, seed, setting, a.task), a.keep)
        print(f"  done: {setting} seed {seed} -> {results[seed, setting]['log']}", file=sys.stderr, flush=True)
    text = report(results, a.seeds, a.settings, a.task, arms)
    if sources:
        text += "\n  (each seed's demonstrations-only arm from " + ", ".join(f"seed {k}: {d}" for k, d in sources.items()) + ")"
    (out / "learning.txt").write_text(text + "\n")  # first: a breakdown or a plot that fails loses no figure
    arm = _arms(results, a.seeds, a.settings, arms)
    text += "\n" + "\n".join(line for setting in a.settings if setting != ARM_ONLY
                              for line in phrasings(results, a.seeds, setting, a.task, arm))
    (out / "learning.txt").write_text(text + "\n")
    plot(results, a.seeds, a.settings, out / "learning.png", a.task, arms)
    text += f"\n  curves: {out / 'learning.png'}"
    (out / "learning.txt").write_text(text + "\n")
    return text


if __name__ == "__main__":
    print(main(sys.argv[1:]))
