"""The agent app's episode loop against a hand-written fake of the `openai` client."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace as NS

from services.demo import agent_app, tools_task

PROBLEM = tools_task.Problem("A crate holds 36 bottles. How many bottles are in 24 crates?", "36 * 24", 864)


def _call(expression: str, call_id: str = "call_1") -> NS:
    fn = NS(name="calculator", arguments=json.dumps({"expression": expression}))
    return NS(content=None, tool_calls=[NS(id=call_id, type="function", function=fn)])


def _text(content: str) -> NS:
    return NS(content=content, tool_calls=None)


class FakeClient:
    """Answers each create() with the next scripted message and keeps what it was sent."""

    def __init__(self, *messages):
        self.script = list(messages)
        self.sent: list[dict] = []
        self.chat = NS(completions=NS(create=self.create))

    async def create(self, **kwargs):
        self.sent.append(json.loads(json.dumps(kwargs)))  # a copy, as it went over the wire
        msg = self.script.pop(0)
        if isinstance(msg, Exception):
            raise msg
        return NS(id=f"chatcmpl-{len(self.sent)}", choices=[NS(message=msg)])


def _run(client, **kwargs) -> agent_app.Episode:
    return asyncio.run(agent_app.run_episode(client, PROBLEM, model="calculator", **kwargs))


def test_a_full_episode_calls_the_tool_runs_it_and_scores_the_answer():
    client = FakeClient(_call("36 * 24"), _text("The answer is 864."))
    ep = _run(client, task_id="t1", run_id="2", max_tokens=40, temperature=0.5)
    assert ep.reward == 1.0 and ep.final == "The answer is 864." and ep.error is None
    assert ep.msg_ids == ["chatcmpl-1", "chatcmpl-2"] and ep.tool_calls == 1 and ep.called_tool_right
    first, second = client.sent
    for sent in client.sent:  # every call of the episode carries its grouping, the tools and the settings
        assert sent["metadata"] == {"task_id": "t1", "run_id": "2"}
        assert sent["tools"] == tools_task.TOOLS and sent["model"] == "calculator"
        assert sent["max_tokens"] == 40 and sent["temperature"] == 0.5
    assert first["messages"] == [{"role": "user", "content": PROBLEM.question}]
    # the second call sees the model's call and the result the app computed, as OpenAI messages
    assert second["messages"][1]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": '{"expression": "36 * 24"}'}
    assert second["messages"][2] == {"role": "tool", "tool_call_id": "call_1", "content": "864"}


def test_a_wrong_expression_gets_its_result_and_scores_zero():
    ep = _run(FakeClient(_call("36 + 24"), _text("The answer is 60.")))
    assert ep.reward == 0.0 and not ep.called_tool_right and ep.messages[2]["content"] == "60"


def test_an_answer_without_the_tool_is_still_scored():
    ep = _run(FakeClient(_text("36 times 24 is 864")))
    assert ep.reward == 1.0 and ep.tool_calls == 0 and ep.msg_ids == ["chatcmpl-1"]


def test_the_turns_run_out_without_an_answer():
    client = FakeClient(_call("36 * 24", "a"), _call("36 * 24", "b"), _call("1 / 0", "c"))
    ep = _run(client, max_turns=3)
    assert ep.final is None and ep.reward == 0.0 and len(ep.msg_ids) == 3 and ep.tool_errors == 1
    assert not client.script


def test_without_a_task_id_no_metadata_is_sent():
    client = FakeClient(_text("864"))
    _run(client)
    assert "metadata" not in client.sent[0]


def test_an_http_error_ends_the_episode_with_the_error_and_no_reward():
    ep = _run(FakeClient(_call("36 * 24"), RuntimeError("503 busy")), task_id="t", run_id="0")
    assert ep.error == "RuntimeError: 503 busy" and ep.reward == 0.0 and ep.msg_ids == ["chatcmpl-1"]


def test_an_exploration_episode_marks_every_call_explore():
    client = FakeClient(_call("36 * 24"), _text("864"))
    _run(client, task_id="t1", run_id="0", explore=True)
    assert [s["metadata"] for s in client.sent] == [{"task_id": "t1", "run_id": "0", "explore": "true"}] * 2
    client = FakeClient(_text("864"))
    _run(client, explore=True)  # no grouping, still an exploration run
    assert client.sent[0]["metadata"] == {"explore": "true"}


def test_a_units_episode_sends_the_converter_runs_it_and_scores_by_its_rule():
    from services.demo import units_task

    problem = units_task.DEMONSTRATION_POOL[0]  # 14 miles in kilometres: 22.53
    fn = NS(name="convert", arguments=json.dumps({"value": 14, "from": "mi", "to": "km"}))
    client = FakeClient(NS(content=None, tool_calls=[NS(id="c", type="function", function=fn)]), _text("That is 22.53."))
    ep = asyncio.run(agent_app.run_episode(client, problem, model="converter"))
    assert client.sent[0]["tools"] == [units_task.CONVERT] and ep.messages[2]["content"] == "22.53"
    assert ep.called_tool_right and ep.reward == 0.5  # the number, but not its unit
    gate = agent_app.GateEnv(problem)
    assert gate.reset() is problem and gate.step("22.53 kilometres")[1] == 1.0
    assert {p.task for p in agent_app.units_gate_problems()} == {"units"} and len(agent_app.units_gate_problems()) == 32
