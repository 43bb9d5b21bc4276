"""Per-agent LoRA adapters found under checkpoints.root, and Hermes tool calls parsed into tool_calls."""

from __future__ import annotations

import concurrent.futures
import json

import pytest

from tests.integration.adapters import publish_adapter, train_reply_adapter

pytestmark = pytest.mark.integration

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in paris?"}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tool_adapter(tiny_model):
    """An adapter trained (a few SFT steps) to answer ASK with a get_weather call, then stop."""
    return train_reply_adapter(tiny_model, ASK, CALL_TEXT, tools=TOOLS)


@pytest.fixture
def agent_explorer(make_explorer, tmp_path, tool_adapter):
    root = tmp_path / "explorer0" / "checkpoints"  # where make_explorer's first instance looks
    publish_adapter(tool_adapter, root, "weather", 1)
    return make_explorer()


def test_agent_adapter_serves_and_tool_calls_are_parsed(agent_explorer):
    ex = agent_explorer
    assert {m.id: m.model_extra.get("version") for m in ex.client.models.list()}["weather"] == 1
    r = ex.client.chat.completions.create(model="weather", messages=ASK, tools=TOOLS, temperature=0, max_tokens=40)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "paris"}
    exp = ex.http.get(f"/experiences/{choice.model_extra['experience_id']}").json()
    assert exp["agent"] == "weather" and exp["model_version"] == 1
    assert exp["response"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert exp["tools"][0]["function"]["name"] == "get_weather"
    assert ex.tokenizer.decode(exp["response_token_ids"], skip_special_tokens=True) == CALL_TEXT


def test_streamed_tool_calls(agent_explorer):
    stream = agent_explorer.client.chat.completions.create(
        model="weather", messages=ASK, tools=TOOLS, temperature=0, max_tokens=40, stream=True
    )
    content, calls, finish = "", [], None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert content == "" and finish == "tool_calls"
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == {"city": "paris"}


def test_base_and_adapter_share_batches_without_mixing(agent_explorer):
    ex = agent_explorer
    base_alone = ex.client.chat.completions.create(model="weather@v0", messages=ASK, tools=TOOLS, temperature=0, max_tokens=40)
    assert base_alone.choices[0].message.tool_calls is None  # the random base model does not call tools

    def one(model):
        return ex.client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=40)

    models = ["weather", "weather@v0", "default"] * 4
    with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
        results = list(pool.map(one, models))
    for model, r in zip(models, results):
        if model == "weather":
            assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
        else:
            assert r.choices[0].message.content == base_alone.choices[0].message.content
    v0 = ex.http.get(f"/experiences/{results[1].choices[0].model_extra['experience_id']}").json()
    assert (v0["agent"], v0["model_version"]) == ("weather", 0)


def test_named_tool_choice_is_decoded_under_the_call_grammar(explorer):
    r = explorer.client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    exp = explorer.http.get(f"/experiences/{r.choices[0].model_extra['experience_id']}").json()
    prompt = explorer.tokenizer.decode(exp["prompt_token_ids"])
    # The prompt ends where the model's turn starts: the whole call is sampled (under its grammar),
    # so it is recorded and trained as the model's own tokens.
    assert prompt.endswith("<|im_start|>assistant\n")
    assert explorer.tokenizer.decode(exp["response_token_ids"]).startswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    assert exp["sampling"]["grammar"]
    # Whole or cut by max_tokens, the call comes back in tool_calls.
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    with pytest.raises(Exception, match="unknown function"):
        explorer.client.chat.completions.create(
            model="default", messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}
        )


def test_tool_choice_none_hides_tools(explorer):
    r = explorer.client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4)
    exp = explorer.http.get(f"/experiences/{r.choices[0].model_extra['experience_id']}").json()
    assert "<tools>" not in explorer.tokenizer.decode(exp["prompt_token_ids"]) and exp["tools"] is None


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_cut_by_max_tokens_comes_back_as_a_cut_call(explorer, tool_choice):
    # As OpenAI answers it: the call as far as it got, in tool_calls, with finish_reason "length";
    # the template's markup is never content. The cuts fall in the tag, in the name and in the
    # arguments (every answer starts '<tool_call>\n{"name": "get_weather", "arguments": ' under the grammar).
    for max_tokens in (1, 4, 8, 14, 18):
        kw = dict(model="default", messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=max_tokens, seed=7)
        r = explorer.client.chat.completions.create(**kw)
        choice = r.choices[0]
        assert r.usage.completion_tokens == max_tokens and choice.finish_reason == "length", max_tokens
        assert choice.message.content is None
        call = choice.message.tool_calls[0]
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        recorded = explorer.http.get(f"/experiences/{choice.model_extra['experience_id']}").json()
        text = explorer.tokenizer.decode(recorded["response_token_ids"])
        assert text.endswith(call.function.arguments) and (call.function.arguments == "" or '"arguments": ' in text)
        # Streamed, the same: the cut call in the last delta, no content.
        chunks = [c for c in explorer.client.chat.completions.create(**kw, stream=True) if c.choices]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
        assert chunks[-1].choices[0].finish_reason == "length"
        streamed = [t for c in chunks for t in c.choices[0].delta.tool_calls or ()]
        assert [(t.function.name, t.function.arguments) for t in streamed] == [("get_weather", call.function.arguments)]
