"""`make bench` section learning (also alone: `python -m tests.bench.learning [--seeds 0 1 2] [--settings ...]`):
what the agent's own traffic gives, pooled over seeds, for each trainer setting of the real demo.

Each (seed, setting) is one `kaizen demo` run (SmolLM2-135M-Instruct with the calculator tool, about
15 minutes on 2 cores): its online loop, and its control arm trained for as many steps on the
demonstrations alone, are measured on the same held-out problems (the split depends on the seed
alone). Printed per run and pooled over seeds, each with a 95% interval from a bootstrap over the
held-out problems stratified by seed:
  - traffic gave: the online loop minus its control arm (the equal-step figure);
  - each setting against the first: the online loops' paired difference on the same problems.
Settings are the demo overrides below: `base` is plain GRPO with the demonstrations replayed every
step, `levers` turns on the Trainer's levers (services/demo/tools_demo.py LEVERS), and each
`no-*` setting is `levers` with one lever off (the ablation).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# demo overrides of each setting (dotted keys of configs/demo.yaml; trainer.* reach the Trainer's config)
SETTINGS: dict[str, list[str]] = {
    "base": ["tools.levers=false"],  # plain GRPO, the demonstrations replayed every step
    "levers": ["tools.levers=true"],  # services/demo/tools_demo.py LEVERS
    "no-self-imitation": ["tools.levers=true", "trainer.algorithm.self_imitation.coef=0"],
    "no-flat-baseline": ["tools.levers=true", "trainer.algorithm.grpo.flat_groups=keep"],
    "no-demo-schedule": ["tools.levers=true", "trainer.algorithm.sft_coef_final=null",
                         "trainer.algorithm.demo_replay=every_step"],
    "no-importance": ["tools.levers=true", "trainer.algorithm.grpo.importance=off"],
}


def run_demo(seed: int, setting: str, out: Path) -> dict:
    run_dir = out / f"{setting}-seed{seed}"
    args = [sys.executable, "-m", "services.cli", "demo", "--config", "configs/demo.yaml", f"seed={seed}",
            f"run_dir={run_dir}", *SETTINGS[setting]]
    log = run_dir.with_suffix(".log")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        r = subprocess.run(args, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise RuntimeError(f"kaizen demo failed ({setting}, seed {seed}): see {log}")
    summary = json.loads(next(run_dir.glob("*/summary.json")).read_text())
    summary["log"] = str(log)
    return summary


def _evals(summary: dict) -> dict[str, list[float]]:
    return {e["label"]: e["per_prompt"] for e in summary["evals"]}


def pooled(pairs: list[tuple[list[float], list[float]]], *, rounds: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Mean of after - before over every (run, problem), with a 95% interval from a bootstrap that
    resamples problems within each run (the runs are the strata)."""
    diffs = [[a - b for b, a in zip(before, after)] for before, after in pairs]
    n = sum(len(d) for d in diffs)
    mean = sum(sum(d) for d in diffs) / n
    rng = random.Random(seed)
    means = sorted(sum(d[rng.randrange(len(d))] for d in diffs for _ in d) / n for _ in range(rounds))
    return mean, means[int(0.025 * rounds)], means[int(0.975 * rounds) - 1]


def report(results: dict[tuple[int, str], dict], seeds: list[int], settings: list[str]) -> str:
    lines = ["learning (SmolLM2-135M-Instruct, calculator tool; held-out success, 95% intervals)", ""]
    for setting in settings:
        pairs = []
        for seed in seeds:
            ev = _evals(results[seed, setting])
            online, control = ev["after online loop"], ev["control: demonstrations only"]
            pairs.append((control, online))
            g, lo, hi = pooled([(control, online)])
            lines.append(f"  {setting:<18} seed {seed}: online {sum(online) / len(online):.2f}, control "
                         f"{sum(control) / len(control):.2f}, traffic gave {g:+.2f} [{lo:+.2f}, {hi:+.2f}], "
                         f"{results[seed, setting]['trainer_steps']} steps")
        g, lo, hi = pooled(pairs)
        lines.append(f"  {setting:<18} pooled over {len(seeds)} seeds: traffic gave {g:+.2f} [{lo:+.2f}, {hi:+.2f}]")
    first = settings[0]
    for setting in settings[1:]:
        pairs = [(_evals(results[s, first])["after online loop"], _evals(results[s, setting])["after online loop"])
                 for s in seeds]
        g, lo, hi = pooled(pairs)
        lines.append(f"  online loop, {setting} - {first}: {g:+.2f} [{lo:+.2f}, {hi:+.2f}] (pooled, paired by problem)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--settings", nargs="+", default=["base", "levers"], choices=sorted(SETTINGS))
    p.add_argument("--out", type=Path, default=None, help="Folder for the runs (default: a temporary one).")
    a = p.parse_args(argv if argv is not None else [])
    out = a.out or Path(tempfile.mkdtemp(prefix="kaizen-learning-"))
    results = {}
    for seed in a.seeds:
        for setting in a.settings:
            results[seed, setting] = run_demo(seed, setting, out)
            print(f"  done: {setting} seed {seed} -> {results[seed, setting]['log']}", file=sys.stderr, flush=True)
    text = report(results, a.seeds, a.settings)
    (out / "learning.txt").write_text(text + "\n")
    return text


if __name__ == "__main__":
    print(main(sys.argv[1:]))
