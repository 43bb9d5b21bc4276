"""The units task (tools.task=units): the converter the app runs, the graded reward, the split and the
demonstrations, all through the same Task as the calculator's."""

from __future__ import annotations

import json
import random
import re

import pytest

from services.demo import tasks
from services.demo import units_task as u


@pytest.mark.parametrize("value, source, target, result", [
    (14, "miles", "kilometres", "22.53"), (250, "cm", "inches", "98.43"), (12, "lb", "kg", "5.44"),
    (2.5, "cups", "ml", "591.47"), (212, "Fahrenheit", "degrees Celsius", "100"), (0, "C", "K", "273.15"),
    (-40, "celsius", "fahrenheit", "-40"), (800, "grams", "Kilograms", "0.8"), (3, "km", "m", "3000"),
    ("1,500", "metres", "km", "1.5"), (2, "grams", "kg", "0.002"), (2, "ml", "cups", "0.008454"), (115, "ml", "l", "0.115"),
    (32, "fahrenheit", "celsius", "0"),
])
def test_the_converter_by_hand(value, source, target, result):
    assert u.run_tool_call("convert", {"value": value, "from": source, "to": target}) == result


@pytest.mark.parametrize("arguments, error", [
    ('{"value": 3, "from": "miles", "to": "kg"}', "error: cannot convert miles to kilograms"),
    ('{"value": 3, "from": "leagues", "to": "km"}', "error: unknown unit 'leagues'"),
    ('{"value": 3, "from": "miles"}', "error: unknown unit None"),
    ('{"value": "three", "from": "miles", "to": "km"}', "error: value 'three' is not a number"),
    ('{"value": true, "from": "miles", "to": "km"}', "error: arguments must be"),
    ('{not json', "error: arguments are not JSON"), ('[3, "miles", "km"]', "error: arguments must be {"),
])
def test_a_call_that_cannot_run_gets_an_error_the_model_can_read(arguments, error):
    assert u.run_tool_call("convert", arguments).startswith(error)
    assert u.run_tool_call("calculator", '{"expression": "1 + 1"}').startswith("error: unknown tool 'calculator'")


def _p(value, source, target):
    return u._pool(0, value, source, target)


@pytest.mark.parametrize("reply, score", [
    ("That is 22.53 kilometres.", 1.0), ("22.53 km", 1.0), ("About 22.5 kilometers", 1.0),  # within 1%
    ("That is 22.53.", 0.5),  # the number without its unit
    ("14 miles is 22.53 kilometres, or 14 miles", 0.0),  # the last number is the answer given
    ("That is 23 kilometres.", 0.0), ("That is 2253 kilometres.", 0.0), ("kilometres", 0.0), ("", 0.0), (None, 0.0),
    ("22.53 in total", 0.5),
])
def test_the_reward_is_graded_right_with_its_unit_right_without_or_wrong(reply, score):
    assert u.score(_p(14, "miles", "kilometres"), reply) == score


def test_short_unit_names_count_only_after_a_number():
    inches = _p(250, "centimetres", "inches")
    assert u.score(inches, "That is 98.43 in") == u.score(inches, "98.43 in.") == 1.0
    assert u.score(inches, "in all, 98.43") == u.score(inches, "98.43 in total") == u.score(inches, "98.43 in centimetres") == 0.5
    hot = u._pool(15, 180, "celsius", "fahrenheit")
    assert u.score(hot, "That is 356 °F.") == u.score(hot, "356 degrees Fahrenheit") == 1.0
    assert u.score(hot, "That is 356 for sure") == 0.5


def test_problems_are_consistent_and_every_phrasing_is_asked():
    rng = random.Random(0)
    for i in range(300):
        p = u.make_problem(rng, template=i % len(u._TEMPLATES))
        args = json.loads(p.expression)
        assert p.task == "units" and f"{args['value']:g}" in p.question
        assert u.run_tool_call("convert", args) == u.TASK.tool_result(p)
        assert u.score(p, u.final_reply(p)) == 1.0
        assert u.unit(args["from"]) and u.TASK.operation(p) == u._UNITS[args["to"]][0]
    assert {u.make_problem(rng).template for _ in range(500)} == set(range(len(u._TEMPLATES)))


def test_the_pool_matches_its_phrasings_and_the_demonstrations_are_whole_episodes():
    for p in u.DEMONSTRATION_POOL:
        pattern = re.sub(r"\\\{[a-z]+\\\}", ".+", re.escape(u._TEMPLATES[p.template][1]))
        assert re.fullmatch(pattern, p.question), (p, pattern)
    demos = u.TASK.demonstrations()
    assert len(demos) == 16
    for call, answer in zip(demos[::2], demos[1::2]):
        problem = next(p for p in u.DEMONSTRATION_POOL if p.question == call["messages"][0]["content"])
        (tool_call,) = call["response"]["tool_calls"]
        assert tool_call["function"]["name"] == "convert" and call["tools"] == [u.CONVERT]
        result = u.run_tool_call("convert", tool_call["function"]["arguments"])
        assert answer["messages"][2]["content"] == result == u.show(problem.answer)
        assert u.score(problem, answer["response"]["content"]) == 1.0
    every = u.TASK.demonstration_problems()
    assert [u.TASK.operation(p) for p in every] == ["l", "l", "m", "m", "v", "v", "t", "t"]
    assert [u.TASK.operation(p) for p in u.TASK.demonstration_problems("lm")] == ["l"] * 4 + ["m"] * 4
    with pytest.raises(ValueError, match=r"operations must be some of 'lmvt' \(task units\)"):
        u.TASK.demonstration_problems("*+")


def test_the_split_keeps_held_out_problems_apart_and_the_registry_finds_each_task():
    s = u.TASK.split(3, 500, 64, 40)
    plain = u.TASK.split(3, 500, 64)
    assert u.TASK.split(3, 500, 64, 40) == s and (s.traffic, s.heldout) == (plain.traffic, plain.heldout)
    groups = [{p.question for p in ps} for ps in (s.traffic, s.heldout, s.validation, u.DEMONSTRATION_POOL)]
    assert sum(map(len, groups)) == len(set().union(*groups))
    assert tasks.get("units") is u.TASK and tasks.get("calculator").tool_name == "calculator"
    with pytest.raises(ValueError, match="unknown task 'maps'; use one of calculator, units"):
        tasks.get("maps")


def test_small_and_zero_answers_keep_their_precision():
    tiny = u._pool(9, 2, "grams", "kilograms")
    assert tiny.answer == 0.002 and u.score(tiny, "That is 0.002 kilograms.") == 1.0
    assert u.score(tiny, "That is 0 kilograms.") == 0.0 and u.score(tiny, "That is 0.00201 kilograms.") == 1.0
    zero = u._pool(19, 32, "fahrenheit", "celsius")
    assert zero.answer == 0 and u.score(zero, "That is 0 celsius.") == 1.0 and u.score(zero, "That is 0.01 celsius.") == 0.0


def test_the_calculators_own_message_for_arguments_that_are_no_object():
    from services.demo import tools_task

    assert tools_task.run_tool_call("calculator", "[1]") == 'error: arguments must be {"expression": "..."}'
    assert u.run_tool_call("convert", '"3 miles"').startswith('error: arguments must be {"value": number')
