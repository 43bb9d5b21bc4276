"""A Trainer that starts its own Ray cluster never leaks it: after ``kill -9`` of the Trainer alone
every process of its cluster is gone within seconds (the guard process), a restart removes what a
killed guard left, and a clean stop leaves nothing. Real ``kaizen trainer`` processes, real Ray."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.trainer.ray_cluster import PROCESSES_FILE, _stat
from tests.helpers import REPO

pytestmark = pytest.mark.integration


def _alive(processes) -> list[int]:
    return [pid for pid, started in processes if (st := _stat(pid)) is not None and st[1] == started]


def _settled(processes, timeout: float = 15.0) -> list[int]:
    """What is still there once the deaths a kill sets off are over (the same set twice, a second
    apart): on a busy machine they can take more than the one second this waited before."""
    last, deadline = _alive(processes), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = _alive(processes)
        if now == last:
            return now
        last = now
    return last


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


class _Trainer:
    def __init__(self, tiny_model: Path, run: Path, label: str):
        self.log = run / f"{label}.log"
        args = [sys.executable, "-m", "services.cli", "trainer", "--config", "configs/trainer.yaml",
                f"model.path={tiny_model}", f"buffer.url=sqlite:///{run}/buffer.db", f"checkpoints.root={run}/ck",
                f"trainer.run_dir={run}/run", "trainer.poll_interval_s=0.2", "log_level=info"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("RAY_ADDRESS", None)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        self.record = run / "run" / PROCESSES_FILE

    def ready(self) -> list[tuple[int, int]]:
        """The cluster's processes once the learners are up."""
        _wait(lambda: "waiting for committed experiences" in self.log.read_text() or self.proc.poll() is not None,
              180, "the Trainer to start")
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        return [tuple(p) for p in json.loads(self.record.read_text())["processes"]]

    def guard_pid(self) -> int:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid), "-f", "services.trainer.ray_cluster"],
                             capture_output=True, text=True).stdout.split()
        assert len(out) == 1, out
        return int(out[0])

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def test_a_killed_trainer_leaves_no_ray_cluster(tiny_model, tmp_path):
    trainers: list[_Trainer] = []
    listed: list[tuple[int, int]] = []
    try:
        first = _Trainer(tiny_model, tmp_path, "first")
        trainers.append(first)
        processes = first.ready()
        listed += processes
        assert len(processes) >= 4, processes  # GCS, raylet, agents, the learner worker
        first.proc.kill()  # kill -9 of the Trainer alone: its process group lives on
        first.proc.wait(30)
        _wait(lambda: not _alive(processes), 30, f"the cluster's processes to go ({_alive(processes)} alive)")

        # The guard killed too (it went with the Trainer's process group, say): the restart cleans up.
        second = _Trainer(tiny_model, tmp_path, "second")
        trainers.append(second)
        processes = second.ready()
        listed += processes
        guard = second.guard_pid()
        for pid, _started in processes:  # stopped, none can notice its peers are gone and exit by itself
            os.kill(pid, signal.SIGSTOP)
        os.kill(guard, signal.SIGKILL)
        second.proc.kill()
        second.proc.wait(30)
        leftovers = _settled(processes)  # what Ray ties to its driver by PR_SET_PDEATHSIG dies; the rest stays
        print(f"after kill -9 of the Trainer and its guard, {len(leftovers)} of {len(processes)} processes stayed")
        third = _Trainer(tiny_model, tmp_path, "third")
        trainers.append(third)
        third.ready()
        assert not _alive(processes), _alive(processes)
        if leftovers:  # the restart killed them; those Ray ties to a killed parent may go with it, not by its hand
            said = re.search(r"killed (\d+) processes of the Ray cluster an earlier run left behind", third.log.read_text())
            assert said and 1 <= int(said.group(1)) <= len(leftovers), (leftovers, third.log.read_text()[-2000:])

        # A clean stop (SIGTERM) leaves nothing either, not even the record.
        processes = [tuple(p) for p in json.loads(third.record.read_text())["processes"]]
        listed += processes
        third.proc.send_signal(signal.SIGTERM)
        assert third.proc.wait(120) == 0, third.log.read_text()[-3000:]
        _wait(lambda: not _alive(processes), 30, "the cluster to stop")
        assert not third.record.exists()
    finally:
        for t in trainers:
            t.kill_group()
        for pid in _alive(listed):
            os.kill(pid, signal.SIGKILL)
