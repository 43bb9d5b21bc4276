"""Shared-prefix prefill and the prefix cache of the hf engine: computing a common prompt prefix
once, or taking it from an earlier request, changes no output.

The engine is driven step by step on this thread (engine_steps.py), so which requests are admitted
together, and when, is fixed by the test rather than by timing.
"""

from __future__ import annotations

import random

import pytest

from services.explorer.serving.engines.base import AdapterRef
from services.explorer.serving.engines.hf import HFEngine
from tests.integration.explorer.engine_steps import assert_same, drive, ids, request

PREFIX_LEN = 60


@pytest.fixture(scope="module")
def engines(tiny_model):
    """(sharing engine, non-sharing engine, sharing and caching engine), loaded from the tiny model,
    float32 on CPU; only the third keeps a prefix cache."""
    out = []
    for min_tokens, cache_mb in ((32, 0), (0, 0), (32, 64)):
        e = HFEngine(model_path=str(tiny_model), dtype="float32", device="cpu", max_batch_size=32,
                     shared_prefix_min_tokens=min_tokens, prefix_cache_mb=cache_mb)
        e._load()
        assert len(e.tokenizer) > 500  # engine_steps.ids draws from the first 500 ids
        out.append(e)
    return out


def test_shared_prefix_prefill_matches_full_prefill(engines):
    sharing, plain, _ = engines
    rng = random.Random(0)
    prefix = ids(rng, PREFIX_LEN, sharing._eos)
    group = [
        request("exact", list(prefix)),  # the prompt is the prefix: the shared part stops one token short
        request("s3", prefix + ids(rng, 3, sharing._eos), n=2),
        request("s10", prefix + ids(rng, 10, sharing._eos)),
        request("s25", prefix + ids(rng, 25, sharing._eos)),
    ]
    before = sharing.shared_prefix_tokens_saved
    got = drive(sharing, {0: group})
    assert sharing.shared_prefix_tokens_saved - before == (PREFIX_LEN - 1) * 3
    want = drive(plain, {0: group})
    assert plain.shared_prefix_tokens_saved == 0
    assert_same(got, want)
    assert_same({"s3": got[("s3", 0)]}, {"s3": got[("s3", 1)]})  # greedy: both choices of one request agree


def test_shared_prefix_prefill_merges_into_a_running_batch(engines):
    sharing, plain, _ = engines
    rng = random.Random(1)
    eos = sharing._eos
    p1, p2 = ids(rng, PREFIX_LEN, eos), ids(rng, 40, eos)
    schedule = {
        # running already: one long prompt (wider than the next group) and one short one
        0: [request("long", ids(rng, 120, eos), max_tokens=14), request("short", ids(rng, 5, eos), max_tokens=14)],
        # joins a batch wider than itself
        2: [request("a1", p1 + ids(rng, 2, eos)), request("a2", p1 + ids(rng, 9, eos), n=2),
            request("a3", list(p1))],
        # joins a batch narrower than itself (long suffixes), with another prefix
        4: [request("b1", p2 + ids(rng, 100, eos)), request("b2", p2 + ids(rng, 7, eos))],
    }
    before = sharing.shared_prefix_tokens_saved
    got = drive(sharing, schedule)
    assert sharing.shared_prefix_tokens_saved - before == (PREFIX_LEN - 1) * 2 + 40 * 1
    want = drive(plain, schedule)
    assert_same(got, want)


def test_shared_prefix_len_rules():
    e = HFEngine(model_path="unused", device="cpu", shared_prefix_min_tokens=4)
    base = list(range(10, 20))
    assert e._shared_prefix_len([base + [1], base + [2, 3]], [None, None]) == 10
    assert e._shared_prefix_len([base, base + [2]], [None, None]) == 9  # every prompt keeps a token
    assert e._shared_prefix_len([base + [1]], [None]) == 0  # one request: nothing to share
    assert e._shared_prefix_len([base[:3] + [1], base[:3] + [2]], [None, None]) == 0  # below the minimum
    assert e._shared_prefix_len([base + [1], base + [2], [7] + base], [None] * 3) == 0
    a = AdapterRef(agent="x", version=1, name="x-v1", int_id=1, path="/nowhere")
    assert e._shared_prefix_len([base + [1], base + [2]], [a.name, a.name]) == 10
    assert e._shared_prefix_len([base + [1], base + [2]], [a.name, None]) == 0  # KV depends on the adapter
    e.shared_prefix_min_tokens = 0
    assert e._shared_prefix_len([base + [1], base + [2]], [None, None]) == 0


def test_a_later_request_takes_the_prefix_an_earlier_one_computed(engines):
    """One request at a time, as a client with concurrency 1 sends them: the second starts with the
    first's 60-token prefix (a system prompt), the third with that prefix too, in a group of two."""
    _, plain, caching = engines
    caching._prefix.clear()
    rng = random.Random(2)
    eos = caching._eos
    prefix = ids(rng, PREFIX_LEN, eos)
    schedule = {0: [request("first", prefix + ids(rng, 5, eos))],
                20: [request("second", prefix + ids(rng, 12, eos))],
                40: [request("g1", prefix + ids(rng, 3, eos)), request("g2", prefix + ids(rng, 30, eos))]}
    hits, reused = caching._prefix.hits, caching._prefix.tokens_reused
    got = drive(caching, schedule)
    assert caching._prefix.hits - hits == 2  # the second request and the group
    assert caching._prefix.tokens_reused - reused == 2 * PREFIX_LEN  # each shares exactly the prefix with the first
    assert_same(got, drive(plain, schedule))
    stats = caching.stats().extra
    assert stats["prefix_cache_hits"] == caching._prefix.hits and stats["prefix_cache_bytes"] > 0


def test_the_next_call_of_a_conversation_takes_the_whole_previous_call(engines):
    """A multi-turn episode: the second call's prompt is the first call's prompt, the tokens it
    generated and a tool result. All of the first call that was computed is reused: its prompt and
    its tokens but the last (sampled, never fed back)."""
    _, plain, caching = engines
    caching._prefix.clear()
    rng = random.Random(3)
    eos = caching._eos
    first = ids(rng, 45, eos)
    out = drive(caching, {0: [request("call1", first, max_tokens=10)]})[("call1", 0)][0]
    second = first + out + ids(rng, 9, eos)  # the model's call, then the tool's result
    reused = caching._prefix.tokens_reused
    got = drive(caching, {0: [request("call2", second, max_tokens=10)]})
    assert caching._prefix.tokens_reused - reused == len(first) + len(out) - 1
    assert_same(got, drive(plain, {0: [request("call2", second, max_tokens=10)]}))


def test_a_group_computes_only_what_the_cache_lacks_of_its_shared_prefix_and_adapters_do_not_mix(engines):
    """The cache holds 40 of the group's 60 shared tokens: the other 20 are computed on top of them,
    once, and the whole 60 kept. An entry of the base model never serves an adapter's request."""
    _, plain, caching = engines
    caching._prefix.clear()
    rng = random.Random(4)
    eos = caching._eos
    prefix = ids(rng, PREFIX_LEN, eos)
    schedule = {0: [request("short", prefix[:40] + ids(rng, 4, eos), max_tokens=4)],
                10: [request("g1", prefix + ids(rng, 6, eos)), request("g2", prefix + ids(rng, 2, eos), n=2)],
                30: [request("again", prefix + ids(rng, 8, eos))]}
    reused = caching._prefix.tokens_reused
    got = drive(caching, schedule)
    assert caching._prefix.tokens_reused - reused == 40 + PREFIX_LEN
    assert_same(got, drive(plain, schedule))
    # the same prompt on an adapter: its keys and values differ, nothing is taken from the base model's
    assert caching._prefix.lookup("calc-v1", prefix + [5]) == (0, None)


def test_next_calls_admitted_together_each_take_their_own_conversation(engines):
    """Two episodes' second calls arrive together: each is prefilled on top of its own first call
    (not only on the system prompt the two share), and the outputs are those of a plain engine."""
    _, plain, caching = engines
    caching._prefix.clear()
    rng = random.Random(5)
    eos = caching._eos
    system = ids(rng, PREFIX_LEN, eos)
    # each conversation holds at least 32 tokens (the cache's minimum) beyond the system prompt: worth a prefill of its own
    firsts = [system + ids(rng, 30, eos), system + ids(rng, 45, eos)]
    outs = drive(caching, {0: [request("a1", firsts[0], max_tokens=10), request("b1", firsts[1], max_tokens=10)]})
    seconds = [f + outs[(rid, 0)][0] + ids(rng, 6, eos) for f, rid in zip(firsts, ("a1", "b1"))]
    schedule = {0: [request("a2", seconds[0]), request("b2", seconds[1])]}
    reused = caching._prefix.tokens_reused
    got = drive(caching, schedule)
    assert caching._prefix.tokens_reused - reused == sum(len(f) + len(outs[(rid, 0)][0]) - 1
                                                         for f, rid in zip(firsts, ("a1", "b1")))
    assert_same(got, drive(plain, schedule))


def test_next_calls_of_many_episodes_are_prefilled_in_one_batch_each_on_its_own_prefix(engines, monkeypatch):
    """Three episodes' next calls arrive together while another request runs, conversations of different
    lengths, one asking for two choices, beside a prompt that shares only their system prompt. The three
    are prefilled in one forward, each row on its own cached conversation; the outputs are those of a
    plain engine and of the same engine prefilling the three one at a time."""
    _, plain, caching = engines
    caching._prefix.clear()
    rng = random.Random(6)
    eos = caching._eos
    system = ids(rng, PREFIX_LEN, eos)
    firsts = [system + ids(rng, n, eos) for n in (35, 50, 70)]
    starts = [request(f"e{k}", f, max_tokens=8) for k, f in enumerate(firsts)]
    outs = drive(caching, {0: starts})
    seconds = [f + outs[(f"e{k}", 0)][0] + ids(rng, 5 + 3 * k, eos) for k, f in enumerate(firsts)]
    stranger = system + ids(rng, 40, eos)  # shares the system prompt alone
    group = [request("n0", seconds[0]), request("n1", seconds[1], n=2), request("n2", seconds[2]), request("x", stranger)]
    schedule = {0: [request("running", ids(rng, 20, eos), max_tokens=12)], 3: group}
    want = drive(plain, schedule)

    forwards = []
    real = caching._forward
    monkeypatch.setattr(caching, "_forward", lambda input_ids, *a, **k: forwards.append(tuple(input_ids.shape)) or real(input_ids, *a, **k))
    results = {}
    for batched in (True, False):
        caching._prefix.clear()
        drive(caching, {0: starts})  # the first calls again: the cache holds their conversations
        caching.batch_own_prefixes = batched
        forwards.clear()
        try:
            results[batched] = drive(caching, schedule)
        finally:
            caching.batch_own_prefixes = True
        # what each next call computes: its tokens after the conversation the cache holds (all but the last
        # generated token, which was never fed back)
        widths = [len(s) - len(f) - len(outs[(f"e{k}", 0)][0]) + 1 for k, (f, s) in enumerate(zip(firsts, seconds))]
        if batched:  # one forward of three rows, as wide as the longest
            assert (3, max(widths)) in forwards and not [w for w in widths if (1, w) in forwards], forwards
        else:  # a forward each
            assert all((1, w) in forwards for w in widths) and not [s for s in forwards if s[0] == 3], forwards
    assert_same(results[True], want)
    assert_same(results[False], want)


def test_identical_prompts_admitted_together_are_computed_once(engines, monkeypatch):
    """A task's runs asked at once (the same prompt, as separate requests, one asking for two choices)
    beside another prompt: two prompts are computed, not five, and each request's outputs are those of
    a plain engine. The same prompt on another adapter would not be the same prompt (not tested here:
    the tiny model has no adapter loaded)."""
    sharing, plain, _ = engines
    rng = random.Random(7)
    eos = sharing._eos
    prefix = ids(rng, PREFIX_LEN, eos)
    task, other = prefix + ids(rng, 12, eos), prefix + ids(rng, 7, eos)
    group = [request("run0", task), request("run1", task, n=2), request("other", other), request("run2", task),
             request("run3", task)]
    rows = []
    real = sharing._forward
    monkeypatch.setattr(sharing, "_forward", lambda input_ids, *a, **k: rows.append(input_ids.shape[0]) or real(input_ids, *a, **k))
    before = sharing.prompts_deduplicated
    got = drive(sharing, {0: group})
    assert sharing.prompts_deduplicated - before == 3 and sharing.stats().extra["prompts_deduplicated"] == sharing.prompts_deduplicated
    # the prefill: their shared prefix once, then the two prompts' own tokens (decode steps, six rows each, take
    # the engine's own fast path here, not this forward)
    assert rows[:2] == [1, 2] and all(r == 6 for r in rows[2:]), rows
    assert_same(got, drive(plain, {0: group}))
    for run in ("run1", "run2", "run3"):  # greedy: every run of the task says what the first says
        assert_same({"r": got[(run, 0)]}, {"r": got[("run0", 0)]})
