"""The hf engine's default torch threads (engines/cpu_paths.default_torch_threads), and the commands
its thread runs for the event loop's callers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os

import pytest
import torch

from services.common import cpus
from services.explorer.serving.engines.base import EngineError, GenerateRequest, SamplingParams
from services.explorer.serving.engines.cpu_paths import default_torch_threads
from services.explorer.serving.engines.hf import HFEngine
from services.explorer.serving.engines.hf_batch import QueuedRequest

CPU = torch.device("cpu")


def test_one_core_is_left_to_the_server_unless_openmp_is_told(monkeypatch, tmp_path):
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(cpus, "CPU_MAX", tmp_path / "cpu.max")  # no container quota, whatever this host's
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)  # torch's own default: the physical cores
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))  # 16 logical CPUs (SMT)
    assert default_torch_threads(CPU) == 7  # the physical cores, less one
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # a pod given two CPUs of the node
    assert default_torch_threads(CPU) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert default_torch_threads(CPU) == 1  # never none
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    (tmp_path / "cpu.max").write_text("300000 100000\n")  # a container allowed 3 CPUs' time: 2 threads
    assert default_torch_threads(CPU) == 2
    (tmp_path / "cpu.max").unlink()
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


def test_what_is_queued_behind_the_stop_is_answered_and_nothing_waits_after_it():
    """A request or an adapter command queued behind the stop (or while the engine thread stopped) gets
    "engine shut down"; once stopped, a new one fails at once instead of waiting for a thread that is gone."""
    async def main() -> None:
        e = HFEngine(model_path="unused", device="cpu")  # no model: the loop only drains commands here
        e._command = lambda op, arg: pytest.fail(f"{op} ran after the stop")
        queued = QueuedRequest(req=None, loop=asyncio.get_running_loop(), out=asyncio.Queue())
        adapter = concurrent.futures.Future()
        e._submit(("stop",))
        e._submit(("req", queued))
        e._submit(("add", "late", adapter))
        e._run()  # the engine thread's loop, here in the test's thread: it takes the stop and ends
        with pytest.raises(EngineError, match="engine shut down"):
            adapter.result(timeout=0)
        answer = await asyncio.wait_for(queued.out.get(), 5)
        assert isinstance(answer, EngineError) and "engine shut down" in str(answer)
        with pytest.raises(EngineError, match="engine shut down"):
            e._submit(("req", queued))
        e._submit(("abort_id", "any"), quiet=True)  # an abort has nothing left to act on: no error
        e._thread = None  # as shutdown() leaves it: stopped, not "never started" (whose commands run inline)
        for late in (e.add_adapter(None), e.generate(GenerateRequest(request_id="r", prompt_token_ids=[1], params=SamplingParams())).__anext__()):
            with pytest.raises(EngineError, match="engine shut down"):
                await late

    asyncio.run(main())


def test_an_engine_loop_that_dies_still_answers_what_was_queued():
    """Whatever ends the engine thread's loop (here an error no step handler catches), the requests
    queued and the batch's rows get "engine shut down", and later calls fail at once."""

    async def main() -> None:
        e = HFEngine(model_path="unused", device="cpu")
        queued = QueuedRequest(req=None, loop=asyncio.get_running_loop(), out=asyncio.Queue())
        e._submit(("req", queued))

        def dies(block: bool) -> None:
            raise KeyboardInterrupt

        e._drain_commands = dies
        with pytest.raises(KeyboardInterrupt):
            e._run()
        answer = await asyncio.wait_for(queued.out.get(), 5)
        assert isinstance(answer, EngineError) and "engine shut down" in str(answer)
        with pytest.raises(EngineError, match="engine shut down"):
            await e.remove_adapter(None)

    asyncio.run(main())
