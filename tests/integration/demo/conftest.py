"""The scaled-down parity demo, run once for this folder's tests (the demo's own checks and the dashboard's)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, built_once

AGENT = "parity"
START_VERSION = 1  # the warm start publishes v1 before the Explorer and the Trainer start
LOOP_SECONDS = 15  # the loop goes on after this until traffic was served by MIN_NEW_VERSIONS new versions ...
MIN_NEW_VERSIONS = 3
MAX_LOOP_SECONDS = 240  # ... but no longer than this (a slow or noisy machine, or a Trainer that never trains)


def _tail(path: Path, n: int = 60) -> str:
    if not path.exists():
        return f"({path.name}: missing)"
    lines = path.read_text(errors="replace").splitlines()
    return f"--- {path.name} (last {n} lines)\n" + "\n".join(lines[-n:])


@pytest.fixture(scope="package")
def demo_run(tiny_model, ray_address, tmp_path_factory) -> Path:
    """One scaled-down demo; its run folder. Shared by the tests of this folder, on whichever test
    worker they run (built once per test run: they only read it)."""

    def build(base: Path) -> None:
        args = [
            sys.executable, "-m", "services.cli", "demo", "--config", "configs/demo.yaml", "task=parity",
            f"run_dir={base / 'runs'}", f"model_path={tiny_model}", f"agent={AGENT}",
            f"duration_s={LOOP_SECONDS}", f"min_new_versions={MIN_NEW_VERSIONS}", f"max_duration_s={MAX_LOOP_SECONDS}",
            "progress_every_s=5",
            "parity.heldout_numbers=8", "parity.eval_samples=2",
            "parity.warm_start.steps=5",
            "parity.traffic.tasks_per_batch=8", "parity.traffic.repeat=4", "parity.traffic.concurrency=16",
            f"trainer.ray.address={ray_address}", "trainer.trainer.poll_interval_s=0.2",
            "explorer.server.log_level=info",  # so explorer.log names every version it hot-loads
        ]
        out = base / "demo.out"
        with open(out, "wb") as f:
            proc = subprocess.run(args, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=600,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        runs = sorted(p for p in (base / "runs").glob("*") if p.is_dir()) if (base / "runs").exists() else []
        logs = "\n".join(_tail(p) for p in [out, *(r / n for r in runs for n in ("explorer.log", "trainer.log"))])
        assert proc.returncode == 0, f"kaizen demo exited with {proc.returncode}\n{logs}"
        assert len(runs) == 1, f"expected one run folder under {base / 'runs'}, found {runs}\n{logs}"
        assert (runs[0] / "summary.json").exists(), logs

    base = built_once(tmp_path_factory, "parity-demo", build)
    return next(p for p in (base / "runs").glob("*") if p.is_dir())
