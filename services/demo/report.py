"""The demo's ending: the table, the plot (PNG) and a summary.json in the run folder, for either task."""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from services.common import buffer, checkpoints
from services.demo.loop import EvalResult


@dataclass
class Stage:
    """A held-out evaluation and what brought it there from the stage before (None for the first)."""

    result: EvalResult
    gain_name: str | None
    note: str = ""


def paired_gain_ci(before: list[float], after: list[float], *, rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of mean(after) - mean(before) by a paired bootstrap over questions (the same
    held-out questions are asked at every stage, so their differences are resampled together)."""
    diffs = [a - b for a, b in zip(after, before)]
    if not diffs:
        return 0.0, 0.0
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(rounds))
    return means[int(0.025 * rounds)], means[int(0.975 * rounds) - 1]


def _traffic_rows(stack) -> tuple[list[dict], dict, object]:
    """Rewarded traffic experiences (evaluation requests are never rewarded, so they are left out)."""
    db = buffer.create_buffer_engine(stack.db_url, create_tables=False)
    rows = [asdict(p) for p in buffer.rewarded_history(engine=db, agent=stack.agent)]
    counts = buffer.count_by_status(engine=db, agent=stack.agent)
    last = buffer.last_trainer_step(engine=db, agent=stack.agent)
    db.dispose()
    return rows, counts, last


def loop_gate(stack, release: list[dict]) -> dict:
    """What the release gate decided about the loop's own versions (tools.gate_every), the release check's
    candidates left out: each measured version (decision, the version it was measured against, difference and
    its bounds, the rule, both versions' scores per gate problem), how many served unmeasured between gates, and
    how many that served were rolled back."""
    db = buffer.create_buffer_engine(stack.db_url, create_tables=False)
    try:
        decisions = buffer.list_decisions(engine=db, agent=stack.agent, limit=100_000)
    finally:
        db.dispose()
    checked = {d["version"] for d in release}
    mine = [d for d in decisions if d.actor == "gate" and d.version not in checked]
    measured = [{"version": d.version, "decision": d.decision, "anchor": (d.figures or {}).get("anchor"),
                 **{k: (d.figures or {}).get(k) for k in ("diff", "lower", "upper", "rule", "best", "scores")}}
                for d in mine if d.decision in ("promoted", "rejected") and not (d.figures or {}).get("between_gates")]
    return {"measured": measured,
            "between_gates": sum(1 for d in mine if (d.figures or {}).get("between_gates")),
            "rolled_back": sum(len((d.figures or {}).get("refused") or []) for d in mine if d.decision == "rolled_back")}


def guard_counts(run: Path) -> dict[str, int]:
    """What the Trainer's guard did (TrainerConfig.guard), from its metrics log: steps it checked,
    redid at a lower learning rate, and refused (weights kept), and those it checked by their KL (max_kl)."""
    path = run / "trainer" / "metrics.jsonl"
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    checked = [s for s in steps if "guard_attempts" in s]
    return {"checked": len(checked), "redone": sum(1 for s in checked if s["guard_attempts"] > 1 and not s["guard_refused"]),
            "refused": sum(1 for s in checked if s["guard_refused"]), "kl": sum(1 for s in checked if "guard_kl" in s)}


def plot(stages: list[Stage], loop, rows: list[dict], path: Path, *, metric: str, title: str, arms: list[Stage] = (),
         kept: list[Stage] = ()) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(16, 4.5), gridspec_kw={"width_ratios": [0.8, 1.2, 1.0]})
    bars = stages + list(arms) + list(kept)
    names = [s.result.label.replace("after ", "after\n").replace(": ", ":\n").replace("demonstrations only", "demonstrations\nonly")
             .replace(", best on", ",\nbest on")
             for s in bars]
    means = [s.result.mean for s in bars]
    errs = [[s.result.mean - s.result.low for s in bars], [s.result.high - s.result.mean for s in bars]]
    colors = (["tab:gray", "tab:orange", "tab:green"][-len(stages):] + ["tab:brown", "tab:olive"][: len(arms)]
              + ["tab:cyan"][: len(kept)])
    ax0.bar(range(len(bars)), means, yerr=errs, capsize=6, color=colors)
    for i, s in enumerate(bars):
        ax0.text(i, min(s.result.high + 0.03, 0.97), f"{s.result.mean:.2f}\nv{s.result.version}", ha="center", fontsize=8)
    ax0.set(xticks=range(len(bars)), ylim=(0, 1.05), ylabel=f"held-out {metric}", title="Held-out questions (95% CI)")
    ax0.set_xticklabels(names, fontsize=8 if len(bars) > len(stages) else None)
    ts = [r.t for r in loop.rounds]
    rs = [r.reward for r in loop.rounds]
    if ts:
        ax1.plot(ts, rs, ".", alpha=0.35, color="tab:blue", label="traffic round (mean reward)")
        w = 8
        smooth = [statistics.fmean(rs[max(0, i - w + 1): i + 1]) for i in range(len(rs))]
        ax1.plot(ts, smooth, "-", color="tab:blue", label=f"moving mean ({w} rounds)")
    start, final = stages[-2].result, stages[-1].result
    ax1.errorbar([0], [start.mean], yerr=[[start.mean - start.low], [start.high - start.mean]], fmt="s", color="tab:orange",
                 capsize=4, label=f"held-out, start (v{start.version})")
    ax1.errorbar([ts[-1] if ts else loop.cfg.duration_s], [final.mean], yerr=[[final.mean - final.low], [final.high - final.mean]],
                 fmt="D", color="tab:green", capsize=4, label=f"held-out, end (v{final.version})")
    ax1.set(xlabel="seconds of online loop", ylabel="reward", ylim=(-0.02, 1.02), title="Reward against time")
    ax1.legend(loc="lower right", fontsize=8)
    by_version: dict[int, list[float]] = {}
    for r in rows:
        by_version.setdefault(r["model_version"], []).append(r["reward"])
    vs = sorted(by_version)
    ax2.plot(vs, [statistics.fmean(by_version[v]) for v in vs], "o-", color="tab:purple", ms=3)
    ax2.set(xlabel="adapter version that produced the answer", ylabel="mean reward of its traffic",
            ylim=(-0.02, 1.02), title="Reward against version")
    fig.suptitle(f"kaizen demo: '{loop.stack.agent}' agent, {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(cfg, stack, loop, stages: list[Stage], *, serving: dict, explorer_requests: dict, seconds: float,
           metric: str, interval: str, title: str, arms: list[Stage] = (), release: list[dict] | None = None,
           curves: dict[str, list[dict]] | None = None, kept: list[Stage] = (),
           compared: list[tuple[EvalResult, EvalResult, str, str]] = ()) -> int:
    """``arms``: control arms measured on the same questions, each compared with the last stage (its
    gain_name names what the last stage had and the arm lacked). ``kept``: more versions measured on them,
    shown after the arms, and ``compared``: more gains, each (before, after, name, note). ``release``: the
    release check's decisions (loop.release_check), whose candidates are not counted as published versions.
    ``curves``: learning curves (name -> points) kept in summary.json."""
    release = release or []
    rows, counts, last = _traffic_rows(stack)
    versions = checkpoints.list_versions(stack.root, stack.agent)
    png = stack.run / "reward.png"
    plot(stages, loop, rows, png, metric=metric, title=title, arms=arms, kept=kept)
    lines = ["", f"Held-out {metric} (questions never asked in traffic; {interval})", ""]
    shown = stages + list(arms) + list(kept)
    width = max(len(s.result.label) for s in shown) + 8
    for s in shown:
        e = s.result
        lines.append(f"  {e.label + f' (v{e.version})':<{width}} {e.mean:5.2f}  [{e.low:.2f}, {e.high:.2f}]")
    lines.append("")
    gains = {}
    # a stage's gain is named by the stage it reached; an arm's, by the arm (what the last stage had and it lacked)
    pairs = [(b, s, s.gain_name, s.note) for b, s in zip(stages, stages[1:])]
    pairs += [(arm, stages[-1], arm.gain_name, arm.note) for arm in arms]
    pairs = [(b.result, s.result, name, note) for b, s, name, note in pairs] + list(compared)
    for before, after, name, note in pairs:
        gain = after.mean - before.mean
        low, high = paired_gain_ci(before.per_prompt, after.per_prompt)
        gains[name] = {"gain": gain, "low": low, "high": high}
        lines.append(f"  {name + ' gave':<20} {gain:+.2f}  [{low:+.2f}, {high:+.2f}]  ({note})")
    lines.append("  (gains: 95% CI by a paired bootstrap over the held-out questions)")
    total = sum(counts.values())
    lines += [
        "",
        f"  experiences recorded {total} (rewarded {len(rows)}, trained on {counts.get('consumed', 0)}, "
        f"discarded {counts.get('discarded', 0)})",
        f"  trainer steps {last.step if last else 0}, versions published {len(versions) - len(release)}, "
        f"versions hot-loaded by the Explorer {serving['reloads']}, failed requests {loop.failed_requests}",
        f"  the online loop: {loop.rates()['episodes_per_s']:.2f} episodes/s, "
        f"{loop.rates()['trainer_steps_per_min']:.1f} Trainer steps per minute",
        f"  wall time {seconds:.0f}s; plot {png}",
        f"  look through it: kaizen dashboard --config {stack.run / 'explorer.yaml'}  (then http://127.0.0.1:8300/)",
    ]
    guard = guard_counts(stack.run)
    if guard["checked"]:
        what = "makes the demonstrations' NLL jump" + (", or moves the policy past guard.max_kl," if guard["kl"] else "")
        lines.insert(-2, f"  guard (an update that {what} is undone): {guard['checked']} steps "
                         f"checked, {guard['redone']} redone at half the learning rate, {guard['refused']} refused")
    gate = loop_gate(stack, release) if cfg.task == "tools" and cfg.tools.gate_every else None
    if gate is not None:
        rejected = sum(1 for m in gate["measured"] if m["decision"] == "rejected")
        lines.insert(-2, f"  the loop's release gate (every {cfg.tools.gate_every}th version measured against the "
                         f"{cfg.tools.gate_against} one it measured, rule {cfg.tools.gate_rule}): {len(gate['measured'])} measured, {len(gate['measured']) - rejected} promoted, "
                         f"{rejected} rejected ({gate['rolled_back']} versions that had served rolled back), "
                         f"{gate['between_gates']} served unmeasured")
    if release:
        lines.insert(-2, "  release check (the gate on hand-published candidates): " + ", ".join(
            f"v{d['version']} {d['candidate']} {d['decision']}" for d in release))
    print("\n".join(lines), flush=True)
    (stack.run / "summary.json").write_text(json.dumps({
        "task": cfg.task,
        "evals": [{"label": s.result.label, "version": s.result.version, "mean": s.result.mean, "low": s.result.low,
                   "high": s.result.high, "ci95": s.result.ci95, "seconds": s.result.seconds,
                   "per_prompt": s.result.per_prompt} for s in shown],  # for pooling runs (several seeds)
        "gains": gains,
        "experiences": counts, "rewarded": len(rows), "trainer_steps": last.step if last else 0,
        "versions_published": len(versions) - len(release), "reloads": serving["reloads"], "failed_requests": loop.failed_requests,
        "guard": guard,
        "release_check": release,
        "loop_gate": gate,
        "explorer_requests": explorer_requests,
        "wall_seconds": seconds, "rounds": [asdict(r) for r in loop.rounds], "curves": curves or {},
        "loop_rates": loop.rates(),
    }, indent=2))
    return 0
