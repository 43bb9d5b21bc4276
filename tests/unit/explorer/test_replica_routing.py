"""ReplicatedEngine's routing (pure logic, fake engines): by load, and the next call of a conversation
to the replica that served the call before it, within ``affinity_slack``."""

from __future__ import annotations

import asyncio

from services.explorer.serving.engines.base import GenerateRequest, SamplingParams
from services.explorer.serving.engines.replicas import ReplicatedEngine
from tests.unit.explorer.fakes import FakeEngine

SYSTEM = list(range(100, 140))  # 40 tokens every prompt shares (a system prompt and its tool list)


def _req(rid: str, ids: list[int]) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=ids, params=SamplingParams(max_tokens=1))


def _serve(engine: ReplicatedEngine, rid: str, ids: list[int], hold: asyncio.Event | None = None):
    """Start a request; while ``hold`` is unset it stays running (counts in its replica's load)."""
    async def run():
        async for _ in engine.generate(_req(rid, ids)):
            if hold is not None:
                await hold.wait()
    return asyncio.ensure_future(run())


def _replica(engine: ReplicatedEngine, rid: str) -> int:
    return next(i for i, e in enumerate(engine.engines) if any(r.request_id == rid for r in e.requests))


def test_the_next_call_of_a_conversation_goes_to_the_replica_that_served_it():
    async def main():
        engine = ReplicatedEngine([FakeEngine(max_batch_size=8), FakeEngine(max_batch_size=8)])
        assert engine.affinity_slack == 2  # a quarter of a replica's batch
        hold = asyncio.Event()
        first_a, first_b = SYSTEM + [1, 2, 3], SYSTEM + [4, 5, 6]
        running = [_serve(engine, "a1", first_a, hold), _serve(engine, "b1", first_b, hold)]
        await asyncio.sleep(0)
        assert (_replica(engine, "a1"), _replica(engine, "b1")) == (0, 1)  # by load: 0 first, then the idle 1
        hold.set()
        await asyncio.gather(*running)
        # a's next call (its first prompt, the reply, a tool result) goes back to 0, b's to 1, whatever their load
        await _serve(engine, "b2", first_b + [7, 8, 9])
        await _serve(engine, "a2", first_a + [7, 8, 9])
        assert (_replica(engine, "a2"), _replica(engine, "b2")) == (0, 1)
        # a third call follows the longest prompt it continues
        await _serve(engine, "a3", first_a + [7, 8, 9, 10])
        assert _replica(engine, "a3") == 0
        assert engine.routed_by_affinity == 3 and engine.stats().extra["routed_by_affinity"] == 3.0
        # a new conversation, and a prompt too short to remember, go by load alone
        await _serve(engine, "c1", SYSTEM + [11])
        await _serve(engine, "short", [1, 2, 3])
        assert engine.routed_by_affinity == 3

    asyncio.run(main())


def test_affinity_gives_way_when_its_replica_is_loaded_beyond_the_slack():
    async def main():
        engine = ReplicatedEngine([FakeEngine(), FakeEngine()], affinity_slack=2)
        first = SYSTEM + [1, 2, 3]
        await _serve(engine, "a1", first)
        assert _replica(engine, "a1") == 0
        hold, held = asyncio.Event(), []
        for k in range(3):  # running continuations of a1: replica 0 at 0, 1, then 2 more than replica 1
            held.append(_serve(engine, f"a2-{k}", first + [10 + k], hold))
            await asyncio.sleep(0)
        assert [_replica(engine, f"a2-{k}") for k in range(3)] == [0, 0, 0]
        held.append(_serve(engine, "a3", first + [20], hold))
        await asyncio.sleep(0)
        assert _replica(engine, "a3") == 1  # 3 more than replica 1, beyond the slack: prefilled again there
        hold.set()
        await asyncio.gather(*held)
        await _serve(engine, "a4", first + [20, 21])
        assert _replica(engine, "a4") == 1  # it continues a3, which replica 1 served

    asyncio.run(main())
