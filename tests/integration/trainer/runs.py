"""Real `kaizen trainer` runs for the fault tests: started as subprocesses on one run dir (the faults
buffer copied in), killed by process group, and what they left read back."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from services.common import buffer, checkpoints
from tests.helpers import REPO

AGENT = "default"
BATCH, INTERVAL = 4, 2


class Trainers:
    """Starts `kaizen trainer` subprocesses on one run dir, each in its own process group, and
    kills every group that is still there on exit (nothing may outlive the test)."""

    def __init__(self, tiny_model: Path, run: Path, ray_address: str, url: str | None = None):
        self.tiny_model, self.run, self.ray_address = tiny_model, run, ray_address
        self.url = url or f"sqlite:///{run}/buffer.db"
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []

    def start(self, label: str, *extra: str, failpoints: str | None = None) -> subprocess.Popen:
        run = self.run
        args = [
            sys.executable, "-m", "services.cli", "trainer", "--config", "configs/trainer.yaml",
            f"model.path={self.tiny_model}", f"buffer.url={self.url}", f"checkpoints.root={run}/ck",
            f"trainer.run_dir={run}/run", f"ray.address={self.ray_address}", "algorithm.name=ppo", "lora.r=8",
            "optim.lr=2e-3", "staleness.max_staleness=100", f"train_batch_size={BATCH}", f"save_interval={INTERVAL}",
            "checkpoints.keep_versions=100", "checkpoints.keep_states=2", "trainer.torch_threads=1",
            "trainer.poll_interval_s=0.2", "log_level=info", *extra,
        ]
        env = {k: v for k, v in os.environ.items() if k != "KAIZEN_FAILPOINTS"}
        env["PYTHONUNBUFFERED"] = "1"
        if failpoints:
            env["KAIZEN_FAILPOINTS"] = failpoints
        log = run / "logs" / f"{len(self.logs):02d}-{label}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            proc = subprocess.Popen(args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs.append(proc)
        self.logs.append(log)
        return proc

    def log(self, proc: subprocess.Popen) -> str:
        return self.logs[self.procs.index(proc)].read_text()

    def kill(self, proc: subprocess.Popen) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        self.wait_learners_gone(proc)

    def wait_learners_gone(self, proc: subprocess.Popen) -> None:
        """A killed driver's learner actors live in the Ray cluster, not in its process group; Ray
        ends them when it sees the driver gone. A restart before that would share the checkpoint
        dir with a dying writer; this test waits, as a restart on a fresh node would."""
        pids = [int(p) for p in re.findall(r"'pid': (\d+)", self.log(proc))]
        deadline = time.monotonic() + 60
        while any(alive(p) for p in pids):
            assert time.monotonic() < deadline, f"learners {pids} outlived their killed driver"
            time.sleep(0.1)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)


def alive(pid: int) -> bool:
    try:
        return not Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")
    except OSError:
        return False


def copy_db(db: Path, run: Path, url: str | None = None) -> str:
    """The faults buffer, as a SQLite file in ``run``, or copied row for row (seq included) into ``url``."""
    run.mkdir(parents=True, exist_ok=True)
    if url is None or url.startswith("sqlite"):
        shutil.copy(db, run / "buffer.db")
        return f"sqlite:///{run}/buffer.db"
    source, target = buffer.create_buffer_engine(f"sqlite:///{db}"), buffer.create_buffer_engine(url)
    with source.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(buffer.experiences.select().order_by(buffer.experiences.c.seq))]
    with target.begin() as conn:
        conn.execute(buffer.experiences.insert(), rows)
    source.dispose()
    target.dispose()
    return url


def steps_of(url: str) -> list[tuple[int, int, int]]:
    """(step, version, consumed) of every trainer_steps row, in insertion order."""
    db = buffer.create_buffer_engine(url)
    t = buffer.trainer_steps
    with db.connect() as conn:
        rows = [tuple(r) for r in conn.execute(t.select().with_only_columns(t.c.step, t.c.version, t.c.consumed).order_by(t.c.id))]
    db.dispose()
    return rows


def adapter_of(root: Path, version: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(checkpoints.version_dir(root, AGENT, version) / "adapter_model.safetensors"))


def killed_at_failpoint(trainers: Trainers, label: str, failpoints: str, *extra: str, wait_s: float = 240.0) -> subprocess.Popen:
    """Start the trainer (with ``extra`` overrides) armed with ``failpoints``; it must die there by SIGKILL (not crash)."""
    proc = trainers.start(label, *extra, failpoints=failpoints)
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{label}: the trainer never reached {failpoints}:\n{trainers.log(proc)[-4000:]}")
    assert proc.returncode == -signal.SIGKILL, (
        f"{label}: the restarted trainer did not reach {failpoints}, it exited with {proc.returncode}:\n"
        f"{trainers.log(proc)[-4000:]}"
    )
    trainers.wait_learners_gone(proc)
    return proc
