"""The hf engine's default torch threads (engines/cpu_paths.default_torch_threads)."""

from __future__ import annotations

import os

import torch

from services.explorer.serving.engines.cpu_paths import default_torch_threads

CPU = torch.device("cpu")


def test_one_core_is_left_to_the_server_unless_openmp_is_told(monkeypatch):
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)  # torch's own default: the physical cores
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))  # 16 logical CPUs (SMT)
    assert default_torch_threads(CPU) == 7  # the physical cores, less one
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # a pod given two CPUs of the node
    assert default_torch_threads(CPU) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert default_torch_threads(CPU) == 1  # never none
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(var, "4")
        assert default_torch_threads(CPU) is None  # torch follows the variable itself
        monkeypatch.delenv(var)
    assert default_torch_threads(torch.device("cuda")) is None
