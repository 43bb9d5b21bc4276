"""Driving the hf engine step by step on the test's own thread (what its thread does, one step at a
time), so which requests are admitted together, and when, is fixed by the test rather than by timing;
and comparing two engines' outputs."""

from __future__ import annotations

import asyncio
import random

import torch

from services.explorer.serving.engines.base import GenerateRequest, SamplingParams
from services.explorer.serving.engines.hf import HFEngine
from services.explorer.serving.engines.hf_batch import QueuedRequest as _Request


def ids(rng: random.Random, n: int, eos: set[int], vocab: int = 500) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        t = rng.randrange(3, vocab)
        if t not in eos:
            out.append(t)
    return out


def request(rid: str, prompt: list[int], n: int = 1, max_tokens: int = 8) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=prompt, n=n,
                           params=SamplingParams(temperature=0.0, max_tokens=max_tokens))


def drive(engine: HFEngine, schedule: dict[int, list[GenerateRequest]]) -> dict[tuple[str, int], tuple[list, list]]:
    """Run the engine's steps here, admitting schedule[step]'s requests (together) at that step.

    Returns (token ids, logprobs) per (request id, choice index).
    """
    engine._reset_batch()
    loop = asyncio.new_event_loop()
    states: list[_Request] = []
    step, last = 0, max(schedule)
    try:
        while True:
            for req in schedule.get(step, []):
                st = _Request(req=req, loop=loop, out=asyncio.Queue())
                states.append(st)
                engine._waiting.append(st)
            if engine._waiting and len(engine._rows) < engine.max_batch_size:
                engine._admit()
                assert not engine._waiting, "the test expects each scheduled group to be admitted at once"
            if not engine._rows and step >= last:
                break
            if engine._rows:
                engine._sample_and_emit()
                engine._prune()
                if engine._rows:
                    engine._decode()
            step += 1
        loop.run_until_complete(asyncio.sleep(0))  # deliver what the engine sent
        results: dict[tuple[str, int], tuple[list, list]] = {}
        for st in states:
            while not st.out.empty():
                item = st.out.get_nowait()
                if isinstance(item, BaseException):
                    raise item
                for u in item:
                    ids, lps = results.setdefault((st.req.request_id, u.index), ([], []))
                    ids.extend(u.token_ids)
                    lps.extend(u.logprobs)
        assert len(results) == sum(st.req.n for st in states)
        return results
    finally:
        loop.close()


def assert_same(shared: dict, full: dict) -> None:
    assert shared.keys() == full.keys()
    for key in full:
        assert shared[key][0] == full[key][0], key
        assert torch.allclose(torch.tensor(shared[key][1]), torch.tensor(full[key][1]), atol=1e-4), key
