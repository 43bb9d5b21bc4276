"""Selection strategies and reward calculators: pure logic, plus the judge against a real HTTP server."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
import time

import pytest
from fastapi import FastAPI, Request  # module level: the route's annotations are resolved here

from runner_sdk import (
    AgentRun,
    ContextThread,
    ContextThreadPoolExecutor,
    ExactMatch,
    ExplicitMarking,
    FunctionReward,
    LLMJudge,
    RegexMatch,
    RequestInfo,
    SamplingRate,
    mark,
)


def test_sampling_rate_is_roughly_p():
    s = SamplingRate(0.3, seed=1)
    n = sum(s.should_select(RequestInfo()).selected for _ in range(10_000))
    assert 2800 < n < 3200  # mean 3000, sd 46
    with pytest.raises(ValueError):
        SamplingRate(1.5)


def test_marks_select_and_carry_labels():
    s = ExplicitMarking()
    assert not s.should_select(RequestInfo()).selected
    with mark("vip", "support", source="chat"):
        d = s.should_select(RequestInfo())
        assert d.selected and d.labels == ("vip", "support") and d.metadata == {"source": "chat"}
        with mark("inner"):
            assert s.should_select(RequestInfo()).labels == ("inner",)
        assert s.should_select(RequestInfo()).labels == ("vip", "support")
    assert not s.should_select(RequestInfo()).selected


def test_mark_expires_after_ttl():
    s = ExplicitMarking(ttl=0.05)
    with mark("x"):
        assert s.should_select(RequestInfo()).selected
        time.sleep(0.08)
        assert not s.should_select(RequestInfo()).selected


def test_mark_follows_tasks_and_threads_started_inside():
    s = ExplicitMarking()
    seen = {}

    def probe(name):
        seen[name] = s.should_select(RequestInfo()).selected

    async def aprobe(name):
        probe(name)

    class Worker(threading.Thread):  # a subclass with its own run()
        def run(self):
            probe("subclass")

    def spawn_nested():
        probe("thread")
        inner = threading.Thread(target=probe, args=("nested",))
        inner.start()
        inner.join()

    async def main():
        with mark("m"):
            await asyncio.create_task(aprobe("task"))
            await asyncio.to_thread(probe, "to_thread")
            for t in (threading.Thread(target=spawn_nested), Worker(), ContextThread(target=probe, args=("context",))):
                t.start()
                t.join()
            with ContextThreadPoolExecutor(2) as pool:
                pool.submit(probe, "context-pool").result()
            # A plain pool's worker outlives this task and must not carry the mark into later ones.
            plain_pool = ThreadPoolExecutor(1)
            plain_pool.submit(probe, "pool-inside").result()
        plain_pool.submit(probe, "pool-later").result()
        plain_pool.shutdown()
        after = threading.Thread(target=probe, args=("outside",))
        after.start()
        after.join()

    asyncio.run(main())
    assert seen == {"task": True, "to_thread": True, "thread": True, "nested": True, "subclass": True,
                    "context": True, "context-pool": True, "pool-inside": False, "pool-later": False,
                    "outside": False}


def test_current_run_follows_threads_started_inside_it():
    from runner_sdk.client import _current_run, _enter_run, current_run
    from runner_sdk.records import AgentRun

    run = AgentRun(task_id="t", run_id="0", input=None, selected=True)
    seen = {}
    token = _enter_run(run)
    try:
        t = threading.Thread(target=lambda: seen.setdefault("inside", current_run()))
        t.start()
        t.join()
    finally:
        _current_run.reset(token)
    t = threading.Thread(target=lambda: seen.setdefault("after", current_run()))
    t.start()
    t.join()
    assert seen == {"inside": run, "after": None}


def test_mark_as_decorator_sync_and_async():
    s = ExplicitMarking()

    @mark("deco")
    def f():
        return s.should_select(RequestInfo()).labels

    @mark("adeco")
    async def g():
        return s.should_select(RequestInfo()).labels

    assert f() == ("deco",) and asyncio.run(g()) == ("adeco",)


def _run(output, expected=None, input=None):
    return AgentRun(task_id="t", run_id="0", input=input, output=output, expected=expected)


def test_match_rewards():
    assert ExactMatch()(_run("  Paris ", "paris")) == 1.0
    assert ExactMatch()(_run("Paris.", "paris")) == 0.0
    assert ExactMatch(normalize=False)(_run("paris", "Paris")) == 0.0
    assert RegexMatch()(_run("The answer is 42.", "42")) == 1.0
    assert RegexMatch()(_run("The answer is 420.", "42")) == 0.0
    assert RegexMatch(r"^\d+$")(_run("17")) == 1.0
    assert FunctionReward(lambda text: len(text) / 10)(_run("hello")) == 0.5
    with pytest.raises(ValueError):
        ExactMatch()(_run("x"))


@pytest.fixture
def judge_server():
    """A real OpenAI-shaped HTTP server on loopback that grades by a fixed rule (is 'Paris' in the answer)."""
    from tests.helpers import ThreadedServer

    app = FastAPI()
    seen = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        seen.append(body)
        user = body["messages"][-1]["content"]
        answer = user.split("Agent's answer:\n")[1].split("\n\n")[0]
        score = "Score: 9" if "Paris" in answer else "2"
        return {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": score}, "finish_reason": "stop"}]}

    with ThreadedServer(app) as s:
        yield s.url, seen


def test_llm_judge_scores_through_an_openai_compatible_endpoint(judge_server):
    url, seen = judge_server
    judge = LLMJudge(base_url=f"{url}/v1", model="grader", rubric="Grade 0-10.")
    assert asyncio.run(judge(_run("It is Paris.", "Paris", input="Capital of France?"))) == pytest.approx(0.9)
    assert asyncio.run(judge(_run("Lyon", "Paris"))) == pytest.approx(0.2)
    assert seen[0]["model"] == "grader" and seen[0]["messages"][0] == {"role": "system", "content": "Grade 0-10."}
    assert "Reference answer:\nParis" in seen[0]["messages"][1]["content"]
