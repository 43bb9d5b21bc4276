"""The hf engine's default torch threads (engines/cpu_paths.default_torch_threads)."""

from __future__ import annotations

import os

import torch

from services.explorer.serving.engines.cpu_paths import default_torch_threads


def test_one_core_is_left_to_the_server_unless_openmp_is_told(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert default_torch_threads(torch.device("cpu")) == max(1, cores - 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert default_torch_threads(torch.device("cpu")) == 1  # never none
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert default_torch_threads(torch.device("cpu")) == 15
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert default_torch_threads(torch.device("cpu")) is None  # torch follows OMP_NUM_THREADS itself
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert default_torch_threads(torch.device("cuda")) is None
