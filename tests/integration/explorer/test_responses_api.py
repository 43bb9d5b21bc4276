"""The Responses API (POST /v1/responses) through the official openai client on a real Explorer:
plain and streamed answers, function calls continued with previous_response_id, structured text,
each answer recorded token for token like a chat (the response id takes feedback), clear 4xx."""

from __future__ import annotations

import json

import openai
import pytest

pytestmark = pytest.mark.integration

TOOLS = [{"type": "function", "name": "lookup", "description": "Look a key up",
          "parameters": {"type": "object", "properties": {"key": {"type": "string", "enum": ["a", "b"]}}, "required": ["key"]}}]


@pytest.fixture
def ex(make_explorer):
    return make_explorer("model.chat_template=hermes-tools")


def _record(ex, response) -> dict:
    return ex.http.get(f"/experiences/{response.model_extra['experience_id']}").json()


def test_a_response_is_answered_and_recorded_like_a_chat(ex):
    r = ex.client.responses.create(model="default", instructions="Be brief.", input="Is 17 even or odd?",
                                   max_output_tokens=6, metadata={"task_id": "parity", "run_id": "3"}, temperature=0.7,
                                   extra_body={"seed": 3})  # a seed whose answer runs past 6 tokens: always cut
    assert r.id.startswith("resp-") and r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output_text == r.output[0].content[0].text and r.output_text
    assert r.usage.output_tokens == len(_record(ex, r)["response_token_ids"]) <= 6
    assert r.usage.output_tokens == 6
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    rec = _record(ex, r)
    assert rec["completion_id"] == r.id and (rec["task_id"], rec["run_id"]) == ("parity", "3")
    assert rec["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Is 17 even or odd?"}]
    assert ex.tokenizer.decode(rec["response_token_ids"], skip_special_tokens=True) == r.output_text
    fb = ex.http.post("/feedback", json={"msg_ids": [r.id], "reward": 1.0})
    assert fb.status_code == 200 and fb.json()["updated"] == 1


def test_a_streamed_response_sends_the_event_sequence_and_the_same_record(ex):
    stream = ex.client.responses.create(model="default", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Say something."}]}], max_output_tokens=8, stream=True, temperature=0.7)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and deltas == final.output_text == next(e.text for e in events if e.type == "response.output_text.done")
    assert kinds.index("response.output_item.added") < kinds.index("response.output_text.delta") < kinds.index("response.output_item.done")
    assert final.usage.output_tokens == len(_record(ex, final)["response_token_ids"])


def test_a_function_call_and_its_output_continue_the_conversation(ex):
    first = ex.client.responses.create(model="default", input="Look up a.", tools=TOOLS, tool_choice="required",
                                       max_output_tokens=40, metadata={"task_id": "kv", "run_id": "0"})
    call = first.output[-1]
    assert call.type == "function_call" and call.name == "lookup" and json.loads(call.arguments) in ({"key": "a"}, {"key": "b"})
    second = ex.client.responses.create(model="default", previous_response_id=first.id, tools=TOOLS, max_output_tokens=6,
                                        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "42"}],
                                        metadata={"task_id": "kv", "run_id": "0"})
    assert second.previous_response_id == first.id
    rec = _record(ex, second)
    assert [m["role"] for m in rec["messages"]] == ["user", "assistant", "tool"]
    assert rec["messages"][1]["tool_calls"][0]["function"]["name"] == "lookup"
    assert rec["messages"][2] == {"role": "tool", "tool_call_id": call.call_id, "content": "42"}
    assert "<tool_response>\n42\n</tool_response>" in ex.tokenizer.decode(rec["prompt_token_ids"])
    # The whole history sent as items gives the same prompt.
    again = ex.client.responses.create(model="default", tools=TOOLS, max_output_tokens=6, input=[
        {"role": "user", "content": "Look up a."},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "42"}])
    assert _record(ex, again)["prompt_token_ids"] == rec["prompt_token_ids"]
    # Streamed, a call comes as its own output item with its arguments.
    events = list(ex.client.responses.create(model="default", input="Look up b.", tools=TOOLS, tool_choice="required",
                                             max_output_tokens=40, stream=True))
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.name == "lookup" and events[-1].response.output[-1].arguments == done.arguments
    # An episode reward reaches both calls.
    assert ex.http.post("/feedback", json={"task_id": "kv", "run_id": "0", "reward": 1.0}).json()["updated"] == 2


def test_structured_text_follows_its_schema(ex):
    schema = {"type": "object", "properties": {"parity": {"type": "string", "enum": ["even", "odd"]}}, "required": ["parity"]}
    r = ex.client.responses.create(model="default", input="Is 17 even or odd?", max_output_tokens=30,
                                   text={"format": {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}})
    assert json.loads(r.output_text)["parity"] in ("even", "odd")


def test_bad_requests_get_clear_errors(ex):
    with pytest.raises(openai.NotFoundError, match="resp_nothing"):
        ex.client.responses.create(model="default", input="hi", previous_response_id="resp_nothing")
    with pytest.raises(openai.BadRequestError) as e:
        ex.client.responses.create(model="default", input="hi", tools=[{"type": "web_search"}])
    assert e.value.body["param"] == "tools.0.type"
    with pytest.raises(openai.BadRequestError) as e:
        ex.client.responses.create(model="default", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/x.png"}]}])
    assert e.value.body["param"] == "input.0.content.0.type"
    with pytest.raises(openai.NotFoundError):
        ex.client.responses.create(model="nobody", input="hi")
    unstored = ex.client.responses.create(model="default", input="hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError, match="store"):
        ex.client.responses.create(model="default", input="more", previous_response_id=unstored.id)
