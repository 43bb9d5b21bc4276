"""Selection strategies and reward calculators: pure logic, plus the judge against a real HTTP server."""

from __future__ import annotations

import asyncio
import contextvars
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

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
    carry_context,
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


def test_mark_follows_tasks_and_the_threads_that_opt_in():
    s = ExplicitMarking()
    seen = {}

    def probe(name):
        seen[name] = s.should_select(RequestInfo()).selected

    async def aprobe(name):
        probe(name)

    class Worker(ContextThread):  # a subclass with its own run()
        def run(self):
            probe("subclass")

    def spawn_nested():
        probe("thread")
        inner = ContextThread(target=probe, args=("nested",))
        inner.start()
        inner.join()

    async def main():
        with mark("m"):
            await asyncio.create_task(aprobe("task"))
            await asyncio.to_thread(probe, "to_thread")
            for t in (ContextThread(target=spawn_nested), Worker(), ContextThread(target=probe, args=("context",)),
                      threading.Thread(target=carry_context(probe), args=("carried",))):
                t.start()
                t.join()
            await asyncio.get_running_loop().run_in_executor(None, carry_context(probe), "executor")
            with ContextThreadPoolExecutor(2) as pool:
                pool.submit(probe, "context-pool").result()
            # A plain pool's worker outlives this task and must not carry the mark into later ones;
            # a task wrapped with carry_context carries it, the worker still does not.
            plain_pool = ThreadPoolExecutor(1)
            plain_pool.submit(carry_context(probe), "pool-carried").result()
            plain_pool.submit(probe, "pool-inside").result()
            # The SDK leaves threading alone: a plain thread keeps Python's own behaviour.
            plain = threading.Thread(target=probe, args=("plain",))
            plain.start()
            plain.join()
        plain_pool.submit(probe, "pool-later").result()
        plain_pool.shutdown()
        after = ContextThread(target=probe, args=("outside",))
        after.start()
        after.join()

    threading_start = threading.Thread.start
    asyncio.run(main())
    assert threading.Thread.start is threading_start
    inherits = bool(getattr(sys.flags, "thread_inherit_context", False))  # Python 3.14+ may opt in for all threads
    assert seen == {"task": True, "to_thread": True, "thread": True, "nested": True, "subclass": True,
                    "context": True, "carried": True, "executor": True, "context-pool": True,
                    "pool-carried": True, "pool-inside": False, "pool-later": False, "plain": inherits,
                    "outside": False}


def test_carried_callable_runs_in_a_fresh_copy_each_call():
    var = contextvars.ContextVar("v", default="unset")
    together = threading.Barrier(4, timeout=10)

    def read_then_change():
        value = var.get()
        var.set("changed inside")  # must not be seen by the next call, nor here
        together.wait()  # four calls inside the carried context at once
        return value

    var.set("outer")
    fn = carry_context(read_then_change)
    var.set("later")
    with ThreadPoolExecutor(4) as pool:  # two rounds of four: the second sees nothing the first set
        assert list(pool.map(lambda _: fn(), range(8))) == ["outer"] * 8
    assert var.get() == "later"


def test_current_run_follows_threads_started_inside_it():
    from runner_sdk.context import current_run, running
    from runner_sdk.records import AgentRun

    run = AgentRun(task_id="t", run_id="0", input=None, selected=True)
    seen = {}
    with running(run):
        t = ContextThread(target=lambda: seen.setdefault("inside", current_run()))
        t.start()
        t.join()
    t = ContextThread(target=lambda: seen.setdefault("after", current_run()))
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
