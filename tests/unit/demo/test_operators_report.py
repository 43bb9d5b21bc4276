"""tests/bench/operators.py and the calculator's operators(): the operator of each first calculator call
against the problem's, by hand."""

import json

from services.demo import tasks
from services.demo.task import Problem
from services.demo.tools_task import operators
from tests.bench.operators import first_call, kind, problems_by_question, tally


def _call(expression: str) -> str:
    return json.dumps({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}]})


def test_operators_as_the_calculator_reads_them():
    assert operators("12 * 34") == "*"
    assert operators("(3 + 4) * 5") == "+*" and operators("3 + 4 * 5") == "+*"  # left to right as written
    assert operators(" 12 × 13") == "*" and operators("9 ÷ 3") == "/"  # what the calculator takes, it reads
    assert operators("63") == ""
    assert operators("5 / 0") == "/"
    for refused in ("5 x 97", "12 // 3", "2 ** 3", "x * 2", "1 +"):
        assert operators(refused) is None, refused


def test_first_call():
    assert first_call(json.loads(_call("1 - 2"))) == "1 - 2"
    assert first_call({"role": "assistant", "content": "It is 3."}) is None
    assert first_call({"tool_calls": [{"function": {"arguments": "{not json"}}]}) == "?"


def test_kind_of_a_row():
    assert kind("r12-q1", "chatcmpl-1") == "traffic"
    assert kind(None, "chatcmpl-1") == "evaluations"
    assert kind(None, "demo-1") is None  # a demonstration or a correction
    assert kind("release-eval/calculator/3", "chatcmpl-1") is None  # the release gate's episodes


def test_the_demo_splits_are_a_prefix_of_the_stream():
    task = tasks.get("calculator")
    split = task.split(5, 30, 20, 10)
    known = problems_by_question(5, count=200)
    assert all(known[p.question] == p for p in [*split.heldout, *split.traffic, *split.validation])


def test_tally_by_version_and_kind():
    sub = Problem("Ana had 700 cups and gave away 200. How many cups are left?", "700 - 200", 500, template=10)
    mul = Problem("What is 12 times 13?", "12 * 13", 156, template=4)
    by_q = {sub.question: sub, mul.question: mul}
    user = lambda p: json.dumps([{"role": "user", "content": p.question}])  # noqa: E731
    rows = [
        ("calculator", 5, user(sub), _call("700 - 200"), "r3-q0", "c1"),
        ("calculator", 5, user(sub), _call("700 * 200"), "r3-q0", "c2"),
        ("calculator", 5, user(mul), json.dumps({"role": "assistant", "content": "156"}), "r3-q1", "c3"),
        ("calculator", 5, user(mul), _call("12 ** 13"), None, "c4"),  # refused by the calculator
        ("calculator", 5, user(mul), _call("12 + 13"), None, "c5"),
        ("calculator", 6, json.dumps([{"role": "user", "content": "What is 1 plus 1?"}]), _call("1 + 1"), None, "c6"),
        # not counted: an answer turn (the tool's result in the messages), another agent's call, a demonstration,
        # the release gate's episode
        ("calculator", 5, json.dumps([{"role": "user", "content": sub.question}, {"role": "tool", "content": "500"}]),
         _call("1 * 1"), "r3-q0", "c7"),
        ("calculator-control", 5, user(sub), _call("700 * 200"), "r3-q0", "c8"),
        ("calculator", 0, user(sub), _call("700 - 200"), None, "demo-9"),
        ("calculator", 5, user(sub), _call("700 * 200"), "release-eval/calculator/0", "c10"),
    ]
    got = tally(rows, by_q, "calculator")
    assert dict(got[5, "traffic"]) == {"right": 1, "- as *": 1, "no call": 1}
    assert dict(got[5, "evaluations"]) == {"garbled": 1, "* as +": 1}
    assert dict(got[6, "evaluations"]) == {"unknown problem": 1}
    assert set(got) == {(5, "traffic"), (5, "evaluations"), (6, "evaluations")}
