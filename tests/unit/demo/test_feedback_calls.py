"""The demo's simulated users' feedback for one episode (services/demo/tools_demo.py ``feedback_calls``),
on episodes written by hand."""

from __future__ import annotations

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
