"""A reply given as a dict, normalized as the chat template takes it, and the checks of its tool calls."""

from __future__ import annotations

import json

import pytest

from services.common.replies import ReplyError, assistant_reply, check_tool_calls

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


def test_a_reply_takes_openais_shape_with_arguments_as_a_string_or_an_object():
    assert assistant_reply({"content": "864"}) == {"role": "assistant", "content": "864"}
    call = assistant_reply({"role": "assistant", "tool_calls": [
        {"id": "c1", "function": {"name": "calculator", "arguments": {"expression": "36 * 24"}}},
        {"function": {"name": "calculator", "arguments": '{"expression": "1 + 1"}'}}]})
    first, second = call["tool_calls"]
    assert call["content"] is None and first == {"id": "c1", "type": "function", "function": {
        "name": "calculator", "arguments": json.dumps({"expression": "36 * 24"})}}
    assert second["id"] == "call_1" and second["function"]["arguments"] == '{"expression": "1 + 1"}'
    check_tool_calls([call], TOOLS)  # both name an offered tool, with a JSON object


@pytest.mark.parametrize("message, error", [
    ({"role": "user", "content": "hi"}, "role 'assistant'"),
    ("864", "role 'assistant'"),
    ({"content": ["864"]}, "content is a string or null"),
    ({"content": None}, "needs content or tool_calls"),
    ({"content": "", "tool_calls": []}, "needs content or tool_calls"),
    ({"tool_calls": [{"function": {"arguments": "{}"}}]}, "tool_calls.0 needs a function with a name"),
])
def test_a_reply_that_is_not_an_assistant_message_is_refused(message, error):
    with pytest.raises(ReplyError, match=error):
        assistant_reply(message)


def test_tool_calls_must_name_an_offered_tool_and_carry_a_json_object():
    def calls(name, arguments):
        return [assistant_reply({"tool_calls": [{"function": {"name": name, "arguments": arguments}}]})]

    with pytest.raises(ReplyError, match="response.tool_calls.0 calls unknown tool 'search': the tools offered are calculator") as e:
        check_tool_calls(calls("search", {}), TOOLS)
    assert (e.value.param, e.value.code) == ("response.tool_calls.0.function.name", "unknown_tool")
    with pytest.raises(ReplyError, match="no tools were offered"):
        check_tool_calls(calls("calculator", {}), None)
    for bad in ("not json", "[1, 2]"):
        with pytest.raises(ReplyError, match="response.tool_calls.0.function.arguments must be a JSON object"):
            check_tool_calls(calls("calculator", bad), TOOLS)
    # an earlier message is named by its index, the last one is the reply
    with pytest.raises(ReplyError, match="messages.0.tool_calls.0 calls unknown tool"):
        check_tool_calls([*calls("search", {}), {"role": "assistant", "content": "ok"}], TOOLS)
