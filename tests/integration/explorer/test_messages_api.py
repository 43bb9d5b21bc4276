"""Anthropic's Messages API (POST /v1/messages) through Anthropic's own SDK on a real Explorer:
plain and streamed answers, tool use continued with tool results, each answer recorded token for
token like a chat (the message id takes feedback), grouping ids by header, clear 4xx."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration

anthropic = pytest.importorskip("anthropic", reason="Anthropic's SDK is a test dependency")

TOOLS = [{"name": "lookup", "description": "Look a key up",
          "input_schema": {"type": "object", "properties": {"key": {"type": "string", "enum": ["a", "b"]}}, "required": ["key"]}}]


@pytest.fixture
def ex(make_explorer):
    return make_explorer("model.chat_template=hermes-tools", "auth.api_keys=[sk-test]", api_key="sk-test")


@pytest.fixture
def client(ex):
    return anthropic.Anthropic(base_url=ex.url, api_key="sk-test", max_retries=0)


def _record(ex, message) -> dict:
    return ex.http.get(f"/experiences/{message.model_extra['experience_id']}").json()


def test_a_message_is_answered_and_recorded_like_a_chat(ex, client):
    m = client.messages.create(model="default", max_tokens=6, system="Be brief.",
                               messages=[{"role": "user", "content": "Is 17 even or odd?"}],
                               extra_headers={"X-Task-Id": "parity", "X-Run-Id": "2"})
    assert m.type == "message" and m.role == "assistant" and m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and (m.stop_reason == "max_tokens") == (m.usage.output_tokens == 6)
    rec = _record(ex, m)
    assert rec["completion_id"] == m.id and (rec["task_id"], rec["run_id"]) == ("parity", "2")
    assert rec["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Is 17 even or odd?"}]
    assert ex.tokenizer.decode(rec["response_token_ids"], skip_special_tokens=True) == m.content[0].text
    assert ex.http.post("/feedback", json={"msg_ids": [m.id], "reward": 0.5}).json()["updated"] == 1


def test_tool_use_and_its_result_continue_the_conversation(ex, client):
    first = client.messages.create(model="default", max_tokens=40, tools=TOOLS, tool_choice={"type": "any"},
                                   messages=[{"role": "user", "content": "Look up a."}])
    use = first.content[-1]
    assert first.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "lookup" and use.input in ({"key": "a"}, {"key": "b"})
    second = client.messages.create(model="default", max_tokens=6, tools=TOOLS, messages=[
        {"role": "user", "content": "Look up a."},
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "42"}]}])
    rec = _record(ex, second)
    assert [m["role"] for m in rec["messages"]] == ["user", "assistant", "tool"]
    assert json.loads(rec["messages"][1]["tool_calls"][0]["function"]["arguments"]) == use.input
    assert rec["messages"][2] == {"role": "tool", "tool_call_id": use.id, "content": "42"}


def test_a_streamed_message_sends_the_event_sequence(ex, client):
    with client.messages.stream(model="default", max_tokens=8,
                                messages=[{"role": "user", "content": "Say something."}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and "content_block_start" in kinds and kinds[-1] == "message_stop"
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text and final.content[0].text == text
    rec = ex.http.get("/experiences", params={"completion_id": final.id}).json()["data"][0]
    assert ex.tokenizer.decode(rec["response_token_ids"], skip_special_tokens=True) == text
    assert final.usage.output_tokens == len(rec["response_token_ids"])


def test_bad_requests_get_clear_errors(client):
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model="default", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    with pytest.raises(anthropic.BadRequestError, match="top_k"):
        client.messages.create(model="default", max_tokens=4, extra_body={"top_k": 5}, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nobody", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=str(client.base_url), api_key="wrong", max_retries=0).messages.create(
            model="default", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
