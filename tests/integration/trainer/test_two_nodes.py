"""The Trainer on a real two-node Ray cluster on loopback: a head node and a worker node, each a
`ray start` of its own with one CPU and a resource naming it, the Trainer the driver on the head.

Two data-parallel learners placed one a node (ray.placement: STRICT_SPREAD); kill -9 of the worker
node (every process of it at once) while the Trainer trains: the Trainer says so in its log and in
/metrics (kaizen_trainer_learners_lost_total), waits for the cluster to place its learners again,
and once the node is back resumes from its last saved state by itself. Every step is committed
once, and every published version equals, within 1e-6, that of two learners on one node that
nobody killed: the step's gradients are the same across nodes, and nothing was trained twice or
skipped. Its learners are gone once it stops.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from services.trainer.ray_cluster import descendants
from tests.helpers import free_port
from tests.integration.trainer.data import FAULT_PROMPTS, FAULT_RESPONSES, FAULT_UNREWARDED
from tests.integration.trainer.runs import BATCH, INTERVAL, Trainers, adapter_of, alive, copy_db, steps_of

pytestmark = pytest.mark.integration

TOTAL = (FAULT_PROMPTS * FAULT_RESPONSES - FAULT_UNREWARDED) // BATCH  # 14 steps, 7 versions
TWO = ("ray.workers=2", "ray.num_cpus_per_worker=1")
WAIT_S = 240.0
# The GCS marks a node dead after this many missed health checks of this period (Ray's defaults, 5 of
# 3 s, would keep this test waiting 15 s for what a kill makes plain at once; 5 of 1 s still leaves a
# busy machine room)
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_worker_niceness": "0",
           "RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "5"}


class TwoNodes:
    """A Ray cluster of two nodes on this machine: each node a `ray start --block` in a process group
    of its own, so that killing the group is the node dying (its raylet, its workers, its actors)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.ray = str(Path(sys.executable).parent / "ray")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {**os.environ, **RAY_ENV}
        self.head = self._node("head", "--head", f"--port={self.port}", f"--ray-client-server-port={free_port()}",
                               "--include-dashboard=false", '--resources={"kaizen_head": 1}')
        self.worker: subprocess.Popen | None = None
        try:
            self.wait_nodes(1)
            self.start_worker()
        except BaseException:
            self.stop()
            raise

    def _node(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.folder / f"ray-{name}.log", "ab")
        proc = subprocess.Popen([self.ray, "start", "--block", "--node-ip-address=127.0.0.1", "--num-cpus=1",
                                 "--object-store-memory=100000000", "--disable-usage-stats", *args],
                                env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        return proc

    def start_worker(self) -> subprocess.Popen:
        self.worker = self._node("worker", f"--address={self.address}", '--resources={"kaizen_worker": 1}')
        self.wait_nodes(2)
        return self.worker

    def nodes(self) -> int:
        r = subprocess.run([self.ray, "status", f"--address={self.address}"], env=self.env, capture_output=True, text=True)
        if r.returncode:
            return 0
        active = r.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0]
        return len(re.findall(r"node_[0-9a-f]+", active))

    def wait_nodes(self, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.nodes() != n:
            assert self.head.poll() is None, f"the Ray head exited: see {self.folder / 'ray-head.log'}"
            assert time.monotonic() < deadline, f"the cluster did not reach {n} node(s) within {timeout}s"
            time.sleep(0.5)

    def kill_worker(self) -> None:
        """Every process of the worker node at once, as when its machine dies (its raylet starts the
        workers in sessions of their own, so the group alone would leave them running for a while)."""
        processes = [(self.worker.pid, 0), *descendants(self.worker.pid)]
        for pid, _ in processes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.worker.wait(30)

    def stop(self) -> None:
        nodes = [proc for proc in (self.worker, self.head) if proc is not None]
        for proc in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)  # `ray start --block` stops its node's processes
        for proc in nodes:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    cluster = TwoNodes(tmp_path_factory.mktemp("two-nodes"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def one_node(tiny_model, faults_db, ray_address, tmp_path_factory) -> Path:
    """Two learners on one node (the session's cluster), nobody killed: the run to match."""
    run = tmp_path_factory.mktemp("one-node")
    copy_db(faults_db, run)
    t = Trainers(tiny_model, run, ray_address)
    try:
        proc = t.start("one-node", *TWO, "--max-steps", str(TOTAL))
        assert proc.wait(WAIT_S) == 0, t.log(proc)[-4000:]
    finally:
        t.close()
    return run


def _learners(log: str) -> list[dict]:
    """The learners of each `learners ready` line: rank, pid and node."""
    return [dict(rank=int(r), pid=int(p), node=n) for line in log.splitlines() if "learners ready: " in line for r, p, n in
            re.findall(r"'rank': (\d+), 'device': '[^']*', 'pid': (\d+), 'node': '([0-9a-f]+)'", line)]


def test_the_worker_node_killed_while_training_the_trainer_recovers_by_itself(tiny_model, faults_db, two_nodes, one_node, tmp_path):
    run = tmp_path / "killed"
    url = copy_db(faults_db, run)
    port = free_port()
    t = Trainers(tiny_model, run, two_nodes.address)
    try:
        proc = t.start("killed", *TWO, "ray.placement=STRICT_SPREAD", "ray.recover_timeout_s=180",
                       f"trainer.metrics_port={port}")

        def wait(cond, what: str) -> None:
            deadline = time.monotonic() + WAIT_S
            while not cond():
                assert proc.poll() is None, f"the trainer exited with {proc.returncode} before {what}:\n{t.log(proc)[-4000:]}"
                assert time.monotonic() < deadline, f"no {what} within {WAIT_S}s:\n{t.log(proc)[-4000:]}"
                time.sleep(0.05)

        wait(lambda: len(steps_of(url)) >= 3, "third step")
        two_nodes.kill_worker()  # the learners train steps back to back: this lands in one
        wait(lambda: "learner worker lost" in t.log(proc), "word of the lost learner")
        killed_after = len(steps_of(url))  # (a step whose last part ran on the head alone may commit just after)
        time.sleep(2)  # the Trainer waits for the cluster to place its learners again
        assert len(steps_of(url)) == killed_after  # nothing trains without the worker node
        two_nodes.start_worker()
        wait(lambda: len(steps_of(url)) == TOTAL, f"all {TOTAL} steps")
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, t.log(proc)[-4000:]
        log = t.log(proc)
    finally:
        t.close()
    assert "kaizen_trainer_learners_lost_total 1.0" in metrics, [m for m in metrics.splitlines() if "lost" in m]
    assert "learner workers rebuilt" in log
    steps = steps_of(url)
    assert [s for s, _, _ in steps] == list(range(1, TOTAL + 1))  # every step committed once
    assert sum(n for _, _, n in steps) == TOTAL * BATCH  # every experience trained once
    for version in range(1, TOTAL // INTERVAL + 1):  # as if on one node, and never killed
        a, b = adapter_of(one_node / "ck", version), adapter_of(run / "ck", version)
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], atol=1e-6, rtol=0)
    learners = _learners(log)
    assert len(learners) == 4, learners  # the first two, then two again
    assert learners[0]["node"] != learners[1]["node"] and learners[2]["node"] != learners[3]["node"], learners  # one a node
    deadline = time.monotonic() + 60
    while any(alive(x["pid"]) for x in learners):  # nothing outlives the Trainer
        assert time.monotonic() < deadline, f"learners {learners} outlived the Trainer"
        time.sleep(0.2)
