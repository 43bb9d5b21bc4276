"""tests/bench/operators.py: the operator of each first calculator call against the problem's, by hand."""

import json

from services.demo.task import Problem
from tests.bench.operators import first_call, operators, tally


def _call(expression: str) -> str:
    return json.dumps({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}]})


def test_operators_of_an_expression():
    assert operators("12 * 34") == "*"
    assert operators("(3 + 4) * 5") == "*+"
    assert operators("63") == ""
    assert operators("5 x 97") == "?"


def test_first_call():
    assert first_call(json.loads(_call("1 - 2"))) == "1 - 2"
    assert first_call({"role": "assistant", "content": "It is 3."}) is None
    bad = {"tool_calls": [{"function": {"arguments": "{not json"}}]}
    assert first_call(bad) == "?"


def test_tally_by_version_and_kind():
    sub = Problem("Ana had 700 cups and gave away 200. How many cups are left?", "700 - 200", 500, template=10)
    mul = Problem("What is 12 times 13?", "12 * 13", 156, template=4)
    by_q = {sub.question: sub, mul.question: mul}
    user = lambda p: json.dumps([{"role": "user", "content": p.question}])  # noqa: E731
    hot, cold = json.dumps({"temperature": 1.3}), json.dumps({"temperature": 1.0})
    rows = [
        ("calculator", 5, user(sub), _call("700 - 200"), hot),
        ("calculator", 5, user(sub), _call("700 * 200"), hot),
        ("calculator", 5, user(mul), json.dumps({"role": "assistant", "content": "156"}), hot),
        ("calculator", 5, user(mul), _call("12 ** 13"), cold),
        ("calculator", 6, json.dumps([{"role": "user", "content": "What is 1 plus 1?"}]), _call("1 + 1"), cold),
        # an answer turn (the tool's result in the messages) and another agent's call: not counted
        ("calculator", 5, json.dumps([{"role": "user", "content": sub.question}, {"role": "tool", "content": "500"}]),
         _call("1 * 1"), hot),
        ("calculator-control", 5, user(sub), _call("700 * 200"), hot),
    ]
    got = tally(rows, by_q, "calculator")
    assert dict(got[5, "traffic"]) == {"right": 1, "- as *": 1, "no call": 1}
    assert dict(got[5, "evaluations"]) == {"* as **": 1}
    assert dict(got[6, "evaluations"]) == {"unknown problem": 1}
    assert set(got) == {(5, "traffic"), (5, "evaluations"), (6, "evaluations")}
