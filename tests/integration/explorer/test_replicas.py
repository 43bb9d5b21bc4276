"""``engine.replicas``: several engines behind one Explorer share the load and reload together."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from services.explorer.serving.engines.replicas import ReplicatedEngine
from tests.integration.adapters import publish_adapter, train_reply_adapter

pytestmark = pytest.mark.integration

ASK = [{"role": "user", "content": "Where should I go?"}]
TARGETS = {1: "Go to paris.", 2: "Go to london."}


@pytest.fixture(scope="module")
def adapters(tiny_model):
    return {v: train_reply_adapter(tiny_model, ASK, t) for v, t in TARGETS.items()}


def test_two_replicas_share_requests_and_reload_together(make_explorer, tmp_path, adapters):
    root = tmp_path / "explorer0" / "checkpoints"
    publish_adapter(adapters[1], root, "guide", 1)
    ex = make_explorer("engine.replicas=2", "engine.torch_threads=1")
    engine = ex.state.engine
    assert isinstance(engine, ReplicatedEngine) and len(engine.engines) == 2

    def ask(_):
        return ex.client.chat.completions.create(model="guide", messages=ASK, temperature=0, max_tokens=12).choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(16)))
    assert answers == [TARGETS[1]] * 16
    produced = [e.tokens_generated for e in engine.engines]
    assert all(n > 0 for n in produced), produced  # both replicas served requests
    deadline = time.monotonic() + 5  # a finished row leaves the batch just after its last token is sent
    while ex.http.get("/health").json()["engine"]["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ex.http.get("/health").json()["engine"]["running"] == 0

    publish_adapter(adapters[2], root, "guide", 2)
    deadline = time.monotonic() + 30
    while ask(0) != TARGETS[2]:
        assert time.monotonic() < deadline, "v2 was not loaded"
        time.sleep(0.1)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, range(8))) == [TARGETS[2]] * 8
    deadline = time.monotonic() + 10
    while any("guide-v1" in e.adapters for e in engine.engines) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [sorted(e.adapters) for e in engine.engines] == [["guide-v2"], ["guide-v2"]]  # v1 released on both


def test_the_next_call_of_a_conversation_goes_to_the_replica_that_served_the_call_before_it(make_explorer, tiny_model):
    ex = make_explorer("engine.replicas=2", "engine.torch_threads=1")
    engine = ex.state.engine
    long_ask = [{"role": "system", "content": "You answer travel questions in one short sentence. " * 6}, *ASK]

    def ask(messages):
        r = ex.client.chat.completions.create(model="default", messages=messages, temperature=0, max_tokens=6)
        return r.choices[0].message.content

    served = [e.tokens_generated for e in engine.engines]
    engine._load[0] += 5  # replica 0 counted busy: the first call goes to replica 1, which by load alone the next would not
    try:
        reply = ask(long_ask)
    finally:
        engine._load[0] -= 5
    first = next(i for i, e in enumerate(engine.engines) if e.tokens_generated > served[i])
    assert first == 1
    assert ex.http.get("/health").json()["engine"]["routed_by_affinity"] == 0
    for turn in range(3):  # each next turn continues the conversation so far, so it stays where it began
        long_ask = [*long_ask, {"role": "assistant", "content": reply}, {"role": "user", "content": f"And then, {turn}?"}]
        before = [e.tokens_generated for e in engine.engines]
        reply = ask(long_ask)
        assert [e.tokens_generated > before[i] for i, e in enumerate(engine.engines)] == [i == first for i in range(2)]
    assert ex.http.get("/health").json()["engine"]["routed_by_affinity"] == 3
