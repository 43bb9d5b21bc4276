"""Where the Trainer's per-step metrics go: JSONL and TensorBoard in the run dir, and the terminal."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("kaizen.trainer")


def _guard_note(record: dict[str, Any]) -> str:
    """What the guard did, when it did something."""
    if record.get("guard_refused"):
        return (f" | GUARD REFUSED {record['guard_attempts']} update(s): demonstrations' nll "
                f"{record['guard_nll_before']:.4f} -> {record['guard_nll_after']:.4f}; weights unchanged")
    if record.get("guard_attempts", 1) > 1:
        return f" | guard: redone at lr {record['lr']:.2g} (nll {record['guard_nll_before']:.4f} -> {record['guard_nll_after']:.4f})"
    return ""


class MetricsSink:
    def __init__(self, run_dir: str | Path, *, progress: bool = True):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.dir / "metrics.jsonl", "a", buffering=1)
        self._tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tensorboard"))
        except Exception as e:  # tensorboard missing or broken: JSONL still has everything
            log.warning("TensorBoard logging disabled: %s", e)
        self._tty = progress and sys.stderr.isatty()
        self._waiting_since: float | None = None

    def step(self, record: dict[str, Any]) -> None:
        record = {"time": time.time(), **record}
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            agent, step = record["agent"], record["step"]
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "time"):
                    self._tb.add_scalar(f"{agent}/{k}", v, step)
            self._tb.flush()
        self._waiting_since = None
        line = (
            f"step {record['step']:>5} {record['agent']} -> v{record['version']}"
            f"{' (published)' if record.get('published') else ''}"
            + (f" | reward {record['reward_mean']:+.3f}±{record['reward_std']:.3f}" if record["reward_mean"] is not None
               else f" | demonstrations only ({record.get('demonstrations', 0)})")
            + (f" | demo nll {record['demo_nll']:.4f}" if record.get("demo_nll") is not None else "")
            + f" | loss {record['loss']:+.4f} kl {record.get('kl', 0.0):.4f} ent {record['entropy']:.3f}"
            f" clip {record.get('clip_frac', 0.0):.2f} | {record['tokens_per_s']:.0f} tok/s"
            f" | stale {record['staleness_mean']:.1f}"
            + _guard_note(record)
        )
        if self._tty:
            sys.stderr.write("\r\033[K" + line + "\n")
            sys.stderr.flush()
        else:
            log.info(line)

    def waiting(self, message: str) -> None:
        """A quiet note that the trainer is idle (a live line on a terminal, one log line a minute otherwise)."""
        now = time.time()
        if self._tty:
            sys.stderr.write("\r\033[K" + time.strftime("%H:%M:%S ") + message)
            sys.stderr.flush()
        elif self._waiting_since is None or now - self._waiting_since > 60:
            log.info(message)
            self._waiting_since = now
        if self._waiting_since is None:
            self._waiting_since = now

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
