import json

from services.common.tool_calls import ToolCallStreamFilter, parse_tool_calls


def test_parse_single_and_multiple_calls():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert calls[0]["function"] == {"name": "get_weather", "arguments": json.dumps({"city": "paris"})}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>'
    content, calls = parse_tool_calls(two)
    assert content is None and [c["function"]["name"] for c in calls] == ["a", "b"]


def test_unterminated_last_call_is_accepted_and_garbage_stays_text():
    content, calls = parse_tool_calls('<tool_call>{"name": "a", "arguments": {"q": "x"}}')
    assert calls and calls[0]["function"]["arguments"] == '{"q": "x"}'
    text = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls(text) == (text, [])
    assert parse_tool_calls("plain answer") == ("plain answer", [])


def test_stream_filter_holds_back_a_possible_call():
    f = ToolCallStreamFilter()
    out = "".join(f.feed(d) for d in ["Hello ", "wor", "ld <to", "ol_call>{\"name\": ", "\"a\"}</tool_call>"])
    assert out == "Hello world "
    rest, calls = f.finish()
    assert rest == "" and calls[0]["function"]["name"] == "a"
    g = ToolCallStreamFilter()
    out = "".join(g.feed(d) for d in ["a <", "b"])  # "<" alone might start a call: held, then released
    rest, calls = g.finish()
    assert out + rest == "a <b" and calls == []


def test_a_call_cut_by_max_tokens_comes_back_cut_and_never_as_markup():
    from services.common.tool_calls import parse_cut_tool_calls

    names = ["get_weather", "get_time"]
    content, calls = parse_cut_tool_calls('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', names)
    assert content == "Sure." and [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Par'}]
    # Cut inside the name: completed when only one offered tool begins so, else no call.
    assert parse_cut_tool_calls('<tool_call>\n{"name": "get_w', names)[1][0]["function"]["name"] == "get_weather"
    assert parse_cut_tool_calls('<tool_call>\n{"name": "get_', names) == (None, [])
    # Cut inside the tag itself, under a forced call of one function: the call with no arguments yet.
    assert [c["function"] for c in parse_cut_tool_calls("<tool_", ["get_time"], forced=True)[1]] == [
        {"name": "get_time", "arguments": ""}]
    # Whole calls before the cut one stay whole; text without markup stays text.
    _, calls = parse_cut_tool_calls('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"na', names)
    assert [c["function"]["name"] for c in calls] == ["get_time"]
    assert parse_cut_tool_calls("just text", names) == ("just text", [])
