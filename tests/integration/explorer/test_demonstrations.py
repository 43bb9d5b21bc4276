"""POST /demonstrations through a real Explorer: the ideal reply is rendered with the served
template exactly as a sampled one (its prompt ids are those a chat with the same messages gets),
stored committed and labelled, and bad input gets a clear 4xx."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
QUESTION = [{"role": "user", "content": "What is 17 * 23?"}]
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "17 * 23"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "391"}


@pytest.fixture
def ex(make_explorer):
    return make_explorer("model.chat_template=hermes-tools")


def test_a_demonstration_is_stored_as_a_sampled_reply_would_be(ex):
    r = ex.http.post("/demonstrations", json={"model": "default", "messages": QUESTION, "tools": TOOLS, "response": CALL,
                                              "task_id": "mul-1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "demonstration" and body["agent"] == "default"
    stored = ex.http.get(f"/experiences/{body['experience_id']}").json()
    assert stored["status"] == "committed" and stored["feedback"]["labels"] == ["demonstration"]
    assert stored["response_logprobs"] == [] and stored["task_id"] == "mul-1"
    tok = ex.tokenizer
    assert stored["response_token_ids"][-1] == tok.eos_token_id  # ends where sampling would stop
    reply = tok.decode(stored["response_token_ids"], skip_special_tokens=False)
    assert reply.startswith("<tool_call>") and '"expression": "17 * 23"' in reply
    # The prompt is exactly what a chat with the same messages and tools is served with.
    chat = ex.http.post("/v1/chat/completions", json={"model": "default", "messages": QUESTION, "tools": TOOLS,
                                                      "max_tokens": 2, "return_token_ids": True}).json()
    assert stored["prompt_token_ids"] == chat["prompt_token_ids"]
    # The final answer after the tool's result, as a second turn of the same episode.
    r = ex.http.post("/demonstrations", json={"model": "default", "messages": [*QUESTION, CALL, RESULT], "tools": TOOLS,
                                              "response": {"role": "assistant", "content": "17 * 23 = 391."}})
    assert r.status_code == 200, r.text
    second = ex.http.get(f"/experiences/{r.json()['experience_id']}").json()
    assert "391" in tok.decode(second["prompt_token_ids"]) and tok.decode(second["response_token_ids"]).startswith("17 * 23")


@pytest.mark.parametrize("body, status, param", [
    ({"response": {**CALL, "tool_calls": [{**CALL["tool_calls"][0], "function": {"name": "search", "arguments": "{}"}}]}},
     400, "response.tool_calls.0.function.name"),
    ({"tools": None}, 400, "response.tool_calls.0.function.name"),
    ({"response": {**CALL, "tool_calls": [{**CALL["tool_calls"][0], "function": {"name": "calculator", "arguments": "17*23"}}]}},
     400, "response.tool_calls.0.function.arguments"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
    ({"messages": []}, 400, "messages"),
    ({"response": {"role": "user", "content": "hi"}}, 400, None),
    ({"response": {"role": "assistant", "content": None}}, 400, None),
    ({"messages": [{"role": "user", "content": "word " * 5000}]}, 400, "messages"),
    ({"model": "default@v1"}, 400, "model"),
    ({"model": "nobody"}, 404, "model"),
])
def test_bad_demonstrations_get_a_clear_4xx(ex, body, status, param):
    full = {"model": "default", "messages": QUESTION, "tools": TOOLS, "response": CALL, **body}
    r = ex.http.post("/demonstrations", json=full)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and (param is None or err["param"] == param), err
    assert ex.http.get("/experiences", params={"status": "committed"}).json()["data"] == []  # nothing stored
