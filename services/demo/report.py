"""The demo's ending: the table, the plot (PNG) and a summary.json in the run folder."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path

from services.common import buffer, checkpoints


def _training_rows(demo) -> list[dict]:
    """Rewarded traffic experiences (evaluation requests are never rewarded, so they are left out)."""
    db = buffer.create_buffer_engine(demo.db_url, create_tables=False)
    rows = [asdict(p) for p in buffer.rewarded_history(engine=db, agent=demo.cfg.agent)]
    counts = buffer.count_by_status(engine=db, agent=demo.cfg.agent)
    last = buffer.last_trainer_step(engine=db, agent=demo.cfg.agent)
    db.dispose()
    return rows, counts, last


def plot(demo, evals, rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ts = [b["t"] for b in demo.batches]
    rs = [b["reward"] for b in demo.batches]
    if ts:
        ax1.plot(ts, rs, ".", alpha=0.35, color="tab:blue", label="traffic round (mean reward)")
        w = 8
        smooth = [statistics.fmean(rs[max(0, i - w + 1): i + 1]) for i in range(len(rs))]
        ax1.plot(ts, smooth, "-", color="tab:blue", label=f"moving mean ({w} rounds)")
    start, final = evals[-2], evals[-1]
    ax1.errorbar([0], [start.mean], yerr=[start.ci95], fmt="s", color="tab:orange", capsize=4,
                 label=f"held-out, start (v{start.version})")
    ax1.errorbar([ts[-1] if ts else demo.cfg.duration_s], [final.mean], yerr=[final.ci95], fmt="D", color="tab:green",
                 capsize=4, label=f"held-out, end (v{final.version})")
    ax1.set(xlabel="seconds of online loop", ylabel="reward", ylim=(-0.02, 1.02), title="Reward against time")
    ax1.legend(loc="lower right", fontsize=8)
    by_version: dict[int, list[float]] = {}
    for r in rows:
        by_version.setdefault(r["model_version"], []).append(r["reward"])
    vs = sorted(by_version)
    ax2.plot(vs, [statistics.fmean(by_version[v]) for v in vs], "o-", color="tab:purple", ms=3)
    ax2.set(xlabel="adapter version that produced the answer", ylabel="mean reward of its traffic",
            ylim=(-0.02, 1.02), title="Reward against version")
    fig.suptitle(f"kaizen demo: '{demo.cfg.agent}' agent, tiny model on CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(demo, evals, start_version: int, serving: dict, seconds: float) -> int:
    rows, counts, last = _training_rows(demo)
    versions = checkpoints.list_versions(demo.root, demo.cfg.agent)
    png = demo.run / "reward.png"
    plot(demo, evals, rows, png)
    start = next(e for e in evals if e.version == start_version)
    final = evals[-1]
    lines = ["", "Held-out reward (questions never asked in traffic; mean ± 95% CI over questions)", ""]
    width = max(len(e.label) for e in evals) + 8
    for e in evals:
        lines.append(f"  {e.label + f' (v{e.version})':<{width}} {e.mean:5.2f} ± {e.ci95:.2f}")
    lines.append("")
    if len(evals) > 2:
        lines.append(f"  warm start gave      {evals[1].mean - evals[0].mean:+.2f}  (supervised on a last-digit code that is right for half the digits)")
    lines.append(f"  online loop gave     {final.mean - start.mean:+.2f}  (v{start.version} -> v{final.version}, "
                 f"same run, measured through the Explorer)")
    total = sum(counts.values())
    lines += [
        "",
        f"  experiences recorded {total} (rewarded {len(rows)}, trained on {counts.get('consumed', 0)}, "
        f"discarded {counts.get('discarded', 0)})",
        f"  trainer steps {last.step if last else 0}, versions published {len(versions)}, "
        f"versions hot-loaded by the Explorer {serving['reloads']}, failed requests {demo.failed_requests}",
        f"  wall time {seconds:.0f}s; plot {png}",
    ]
    text = "\n".join(lines)
    print(text, flush=True)
    (demo.run / "summary.json").write_text(json.dumps({
        "evals": [{"label": e.label, "version": e.version, "mean": e.mean, "ci95": e.ci95} for e in evals],
        "online_gain": final.mean - start.mean,
        "warm_start_gain": evals[1].mean - evals[0].mean if len(evals) > 2 else None,
        "experiences": counts, "rewarded": len(rows), "trainer_steps": last.step if last else 0,
        "versions_published": len(versions), "reloads": serving["reloads"], "failed_requests": demo.failed_requests,
        "explorer_requests": demo.explorer_requests,
        "wall_seconds": seconds, "rounds": demo.batches,
    }, indent=2))
    return 0
