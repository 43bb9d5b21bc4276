"""The demo's simulated users' feedback for one episode (services/demo/tools_demo.py ``feedback_calls``),
on episodes written by hand."""

from __future__ import annotations

import json
import random

import pytest

from services.demo import tasks, tools_task
from services.demo.agent_app import Episode
from services.demo.tools_demo import feedback_calls

TASK = tasks.get("calculator")
PROBLEM = tools_task.Problem("A crate holds 36 bottles. How many bottles are in 24 crates?", "36 * 24", 864)
HINT = TASK.hint(PROBLEM)
CORRECTION = TASK.demonstration_turns(PROBLEM)[0]["response"]


def _episode(run: str, turns: list[tuple[str, str] | str], reward: float) -> Episode:
    """``turns``: (expression, the calculator's result) for each tool call, then the final reply."""
    messages = [{"role": "user", "content": PROBLEM.question}]
    for k, turn in enumerate(turns):
        if isinstance(turn, str):
            messages.append({"role": "assistant", "content": turn})
            continue
        call = {"id": f"c{k}", "type": "function", "function": {"name": "calculator", "arguments": f'{{"expression": "{turn[0]}"}}'}}
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": f"c{k}", "content": turn[1]}]
    return Episode(problem=PROBLEM, task_id="t", run_id=run, msg_ids=[f"m{run}-{k}" for k in range(len(turns))],
                   messages=messages, final=turns[-1], reward=reward)


RIGHT = _episode("0", [("36 * 24", "864"), "864"], 1.0)
BAD_CALL = _episode("1", [("36 + 24", "60"), "60"], 0.0)
BAD_ANSWER = _episode("2", [("36 * 24", "864"), "846"], 0.0)  # the call computed the answer; the reply miscopied it
SECOND_CALL_RIGHT = _episode("3", [("36 + 24", "60"), ("36 * 24", "864"), "846"], 0.0)
NO_TOOL = _episode("4", ["860"], 0.0)


def _reward(ep: Episode) -> dict:
    return {"msg_ids": ep.msg_ids, "reward": ep.reward, "task_id": "t", "run_id": ep.run_id}


def test_the_episodes_are_what_they_say():
    assert RIGHT.first_call_right and RIGHT.called_tool_right
    assert not BAD_CALL.first_call_right and not BAD_CALL.called_tool_right
    assert BAD_ANSWER.first_call_right and BAD_ANSWER.called_tool_right
    assert not SECOND_CALL_RIGHT.first_call_right and SECOND_CALL_RIGHT.called_tool_right
    assert not NO_TOOL.first_call_right and not NO_TOOL.called_tool_right


@pytest.mark.parametrize("words", ["off", "hints", "corrections"])
@pytest.mark.parametrize("scope", ["episode", "tool"])
def test_a_right_answer_gets_its_reward_alone_and_so_does_any_answer_without_words(words, scope):
    assert feedback_calls(RIGHT, TASK, words=words, hint_calls=scope) == [_reward(RIGHT)]
    for ep in (BAD_CALL, BAD_ANSWER, SECOND_CALL_RIGHT, NO_TOOL):
        assert feedback_calls(ep, TASK, words="off", hint_calls=scope) == [_reward(ep)]


def test_hints_on_the_whole_episode_go_with_the_reward_to_every_call_of_a_wrong_one():
    for ep in (BAD_CALL, BAD_ANSWER, SECOND_CALL_RIGHT, NO_TOOL):
        assert feedback_calls(ep, TASK, words="hints") == [_reward(ep) | {"hint": HINT}]


def test_hints_on_the_tool_call_go_to_the_first_call_alone_when_it_did_not_compute_the_answer():
    for ep in (BAD_CALL, SECOND_CALL_RIGHT, NO_TOOL):  # a wrong call, or no call where one was due
        assert feedback_calls(ep, TASK, words="hints", hint_calls="tool") == [_reward(ep), {"msg_ids": ep.msg_ids[:1], "hint": HINT}]
    # the first call was right: what went wrong came after it, and the hint says nothing new of it
    assert feedback_calls(BAD_ANSWER, TASK, words="hints", hint_calls="tool") == [_reward(BAD_ANSWER)]


@pytest.mark.parametrize("scope", ["episode", "tool"])
def test_corrections_correct_the_first_call_unless_a_tool_call_computed_the_answer(scope):
    for ep in (BAD_CALL, NO_TOOL):
        assert feedback_calls(ep, TASK, words="corrections", hint_calls=scope) == [
            _reward(ep), {"msg_ids": ep.msg_ids[:1], "correction": CORRECTION}]
    for ep in (BAD_ANSWER, SECOND_CALL_RIGHT):  # as these were measured (docs/DEMO.md)
        assert feedback_calls(ep, TASK, words="corrections", hint_calls=scope) == [_reward(ep)]


def test_a_run_the_user_was_not_served_gets_no_correction_and_hints_still():
    for ep in (BAD_CALL, NO_TOOL):
        assert feedback_calls(ep, TASK, words="corrections", corrects=False) == [_reward(ep)]
    assert feedback_calls(BAD_CALL, TASK, words="hints", corrects=False) == [_reward(BAD_CALL) | {"hint": HINT}]


def test_no_call_recorded_no_feedback_and_unknown_words_refused():
    assert feedback_calls(Episode(problem=PROBLEM, task_id="t", run_id="9"), TASK, words="hints") == []
    with pytest.raises(ValueError, match="words='shouts'"):
        feedback_calls(BAD_CALL, TASK, words="shouts")


SWAPPED = _episode("5", [("24 * 36", "864"), "846"], 0.0)  # the right call, numbers swapped: still computes the answer
RIGHT_OPERATOR = _episode("6", [("36 * 42", "1512"), "1512"], 0.0)  # the right operator, a wrong number
RIGHT_OPERATOR_LATE = _episode("7", [("36 + 24", "60"), ("30 * 24", "720"), "720"], 0.0)
TWO_OPERATORS = _episode("8", [("36 * 24 + 1", "865"), "865"], 0.0)  # "*+" is not the problem's "*"
UNPARSED = _episode("9", [("36 ** 24", "error: only numbers, + - * / and parentheses are allowed"), "0"], 0.0)


def test_call_grades_worked_by_hand():
    grade = lambda ep: TASK.call_grade(PROBLEM, ep.messages)  # noqa: E731
    assert [grade(ep) for ep in (RIGHT, BAD_ANSWER, SECOND_CALL_RIGHT, SWAPPED)] == [1.0] * 4
    assert [grade(ep) for ep in (RIGHT_OPERATOR, RIGHT_OPERATOR_LATE)] == [0.5, 0.5]
    assert [grade(ep) for ep in (BAD_CALL, TWO_OPERATORS, UNPARSED, NO_TOOL)] == [0.0] * 4


def test_call_credit_rewards_a_wrong_answer_for_its_call_and_never_lowers_a_reward():
    credit = lambda ep: feedback_calls(ep, TASK, call_credit=0.2)[0]["reward"]  # noqa: E731
    assert credit(RIGHT) == 1.0
    assert credit(BAD_ANSWER) == credit(SECOND_CALL_RIGHT) == 0.2
    assert credit(RIGHT_OPERATOR) == 0.1
    assert credit(BAD_CALL) == credit(NO_TOOL) == 0.0
    # off by default; and the words that follow a wrong answer still follow it
    assert feedback_calls(BAD_ANSWER, TASK)[0]["reward"] == 0.0
    assert feedback_calls(BAD_CALL, TASK, words="hints", call_credit=0.2) == [_reward(BAD_CALL) | {"hint": HINT}]
    assert feedback_calls(RIGHT_OPERATOR, TASK, words="hints", call_credit=0.2) == [
        _reward(RIGHT_OPERATOR) | {"reward": 0.1, "hint": HINT}]


def test_units_call_credit_asks_for_both_units_and_keeps_a_half_answer():
    units = tasks.get("units")
    p = units.make_problem(random.Random(3), None)
    args = json.loads(p.expression)
    swapped = {"value": args["value"], "from": args["to"], "to": args["from"]}

    def ep(arguments: dict, final: str, reward: float) -> Episode:
        call = {"id": "c0", "type": "function", "function": {"name": "convert", "arguments": json.dumps(arguments)}}
        messages = [{"role": "user", "content": p.question}, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c0", "content": units.run_tool_call("convert", arguments)},
                    {"role": "assistant", "content": final}]
        return Episode(problem=p, task_id="t", run_id="0", msg_ids=["m0", "m1"], messages=messages, final=final, reward=reward)

    right_units = ep(args | {"value": args["value"] + 1}, "no idea", 0.0)
    assert units.call_grade(p, right_units.messages) == 0.5
    assert units.call_grade(p, ep(swapped, "no idea", 0.0).messages) == 0.0
    assert units.call_grade(p, ep(args, "no idea", 0.0).messages) == 1.0
    assert feedback_calls(right_units, units, call_credit=0.4)[0]["reward"] == 0.2
    half = ep(args, "The answer is ...", 0.5)  # a graded answer above the credit keeps its own reward
    assert feedback_calls(half, units, call_credit=0.4)[0]["reward"] == 0.5
