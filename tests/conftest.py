"""Session fixtures shared by every tier: the tiny model is built once per test session."""

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
