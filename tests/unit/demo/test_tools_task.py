"""The calculator task: the tool the app runs, the reward rule, the split and the demonstrations."""

from __future__ import annotations

import json

import pytest

from services.demo import tools_task as t


@pytest.mark.parametrize("expression, value", [
    ("36 * 24", "864"), ("1071 / 17", "63"), ("7 / 2", "3.5"), ("(3 + 4) * -2", "-14"), ("  12 ×  3 ", "36"),
    ("2.5 * 4", "10"), ("1 / 3", "0.333333"),
])
def test_calculator_evaluates_arithmetic(expression, value):
    assert t.calculate(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os')", "2 ** 10", "abs(-3)", "x + 1", "3 +", "1 / 0", "9" * 201, "True + 1"])
def test_calculator_refuses_anything_else_with_an_error_text(expression):
    assert t.calculate(expression).startswith("error:")


def test_a_tool_call_that_cannot_run_gets_an_error_the_model_can_read():
    assert t.run_tool_call("calculator", '{"expression": "6 * 7"}') == "42"
    assert t.run_tool_call("calculator", {"expression": "6 * 7"}) == "42"
    assert t.run_tool_call("search", '{"q": "x"}').startswith("error: unknown tool")
    assert t.run_tool_call("calculator", "{not json").startswith("error:")
    assert t.run_tool_call("calculator", '{"expr": "6 * 7"}').startswith("error:")
    assert t.run_tool_call("calculator", '["6 * 7"]').startswith("error:")


@pytest.mark.parametrize("reply, score", [
    ("The answer is 864.", 1.0),
    ("36 * 24 = 864", 1.0),  # the last number counts, not the first
    ("864", 1.0), ("It is 864.0", 1.0),
    ("The answer is 864, or maybe 865.", 0.0),  # listing numbers does not help: the last one is the answer given
    ("The answer is 8640.", 0.0), ("The answer is -864.", 0.0), ("no idea", 0.0), ("", 0.0), (None, 0.0),
])
def test_reward_is_one_when_the_last_number_of_the_final_reply_is_the_answer(reply, score):
    assert t.reward(864, reply) == score


def test_reward_reads_thousands_separators():
    assert t.reward(1196, "The answer is 1,196.") == 1.0


def test_problems_are_consistent_and_hard_to_guess():
    import random

    rng = random.Random(0)
    for i in range(200):
        p = t.make_problem(rng, template=i % len(t._TEMPLATES))
        a, op, b = p.expression.split()
        assert t.calculate(p.expression) == str(p.answer)  # divisions are exact
        assert a in p.question and b in p.question
        assert p.answer >= 10  # nothing a model gets right by writing a small number


def test_split_is_seeded_and_keeps_held_out_problems_out_of_traffic_and_demonstrations():
    s = t.split(3, 500, 64)
    assert len(s.traffic) == 500 and len(s.heldout) == 64
    assert t.split(3, 500, 64) == s and t.split(4, 500, 64) != s
    traffic, heldout = {p.question for p in s.traffic}, {p.question for p in s.heldout}
    demos = {p.question for p in t.DEMONSTRATION_POOL}
    assert len(traffic) == 500 and len(heldout) == 64
    assert not traffic & heldout and not demos & (traffic | heldout)


def test_at_most_16_demonstrations_each_a_whole_episode():
    demos = t.demonstrations()
    assert len(demos) == 16 and len(t.demonstrations(6)) == 6
    for call, answer in zip(demos[::2], demos[1::2]):
        (user,) = call["messages"]
        problem = next(p for p in t.DEMONSTRATION_POOL if p.question == user["content"])
        assert call["tools"] == t.TOOLS == answer["tools"]
        (tool_call,) = call["response"]["tool_calls"]
        assert call["response"]["content"] is None and tool_call["function"]["name"] == "calculator"
        args = json.loads(tool_call["function"]["arguments"])
        assert t.calculate(args["expression"]) == str(problem.answer)
        # the answer turn continues the same episode: the call, the tool's result, then the reply
        assert answer["messages"][:2] == [user, call["response"]]
        assert answer["messages"][2] == {"role": "tool", "tool_call_id": tool_call["id"], "content": str(problem.answer)}
        assert t.reward(problem.answer, answer["response"]["content"]) == 1.0


def test_demonstrations_show_the_chosen_operations_and_leave_most_phrasings_to_traffic():
    import random

    import re

    for p in t.DEMONSTRATION_POOL:  # each is an instance of the phrasing it names
        op, text = t._TEMPLATES[p.template]
        pattern = re.sub(r"\\\{[a-z]+\\\}", ".+", re.escape(text))
        assert p.expression.split()[1] == op == t.operation(p) and re.fullmatch(pattern, p.question), (p, pattern)
        assert t.calculate(p.expression) == str(p.answer)
    every = t.demonstration_problems()
    assert len(every) == 8 and {t.operation(p) for p in every} == {"+", "-", "*", "/"}
    assert len({p.template for p in every}) <= len(t._TEMPLATES) // 2
    two = t.demonstration_problems("*+")
    assert len(two) == 8 and [t.operation(p) for p in two] == ["*"] * 4 + ["+"] * 4
    assert len(t.demonstrations(16, "*+")) == 16
    for bad in ("", "*x", "%"):
        with pytest.raises(ValueError, match="operations must be"):
            t.demonstration_problems(bad)
    rng = random.Random(0)
    assert {t.make_problem(rng).template for _ in range(500)} == set(range(len(t._TEMPLATES)))  # traffic asks them all


def test_validation_problems_are_apart_from_the_rest_and_change_nothing_else():
    s, v = t.split(3, 500, 64), t.split(3, 500, 64, 40)
    assert (v.traffic, v.heldout) == (s.traffic, s.heldout) and s.validation == []
    validation = {p.question for p in v.validation}
    assert len(validation) == 40
    others = {p.question for p in v.traffic + v.heldout + t.DEMONSTRATION_POOL}
    assert not validation & others


def test_the_held_out_problems_depend_on_the_seed_and_their_number_alone():
    from services.demo import tasks

    for name in ("calculator", "units"):
        task = tasks.get(name)
        full = task.split(11, 2000, 80, 40).heldout
        assert task.split(11, 16, 80).heldout == full == task.split(11, 0, 80).heldout
        assert task.split(11, 0, 40).heldout == full[:40]
        assert task.split(12, 0, 80).heldout != full
