"""The hf engine's default torch threads (engines/cpu_paths.default_torch_threads), and the commands
its thread runs for the event loop's callers."""

from __future__ import annotations

import concurrent.futures
import os

import torch

from services.explorer.serving.engines.cpu_paths import default_torch_threads
from services.explorer.serving.engines.hf import HFEngine

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


def test_a_command_whose_caller_was_cancelled_never_runs_and_the_next_still_does():
    """An adapter command awaited by a caller that was cancelled before the engine's thread took it
    (a shutdown, a timeout) is skipped: it once raised InvalidStateError there, logged as a failed step."""
    e = HFEngine(model_path="unused", device="cpu")  # the model loads in start(), never called here
    ran = []
    e._command = lambda op, arg: ran.append((op, arg))
    gone, kept = concurrent.futures.Future(), concurrent.futures.Future()
    gone.cancel()
    e._cmds.put(("remove", "cancelled", gone))
    e._cmds.put(("clear", None, kept))
    e._drain_commands(block=False)
    assert ran == [("clear", None)] and kept.result(timeout=0) is None and gone.cancelled()
