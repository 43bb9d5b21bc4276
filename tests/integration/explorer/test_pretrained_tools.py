"""A multi-turn tool conversation with the real SmolLM2 through a real Explorer and the openai client.

The conversation opens with one worked exchange (a call with null content, its result, an answer).
The forced call (tool_choice names it: decoded under the call's grammar) comes back as tool_calls; the next turn sends it back with the tool's result. Both
prompts render with the model directory's own hermes-tools template, are recorded with their
messages and tools, and are exactly the ids the Trainer's tokenizer renders from the recorded messages.
"""

from __future__ import annotations

import json

import pytest

from services.common.chat_templates import load_tokenizer

pytestmark = pytest.mark.integration

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
FORCE = {"type": "function", "function": {"name": "get_weather"}}
RESULT = "18 degrees Celsius and sunny"
EXAMPLE = [
    {"role": "system", "content": "You are a weather assistant."},
    {"role": "user", "content": "What is the weather in Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": "25 degrees Celsius and clear"},
    {"role": "assistant", "content": "It is 25 degrees Celsius and clear in Rome."},
]


@pytest.fixture
def smol(make_explorer, smollm2_model):
    return make_explorer(f"model.path={smollm2_model}", "engine.max_model_len=2048")


def _experience(ex, choice) -> dict:
    return ex.http.get(f"/experiences/{choice.model_extra['experience_id']}").json()


def test_a_multi_turn_tool_conversation_renders_records_and_parses(smol, smollm2_model):
    trainer_tok = load_tokenizer(smollm2_model)  # as the Trainer's policy loads it

    def trainer_ids(e):
        text = trainer_tok.apply_chat_template(e["messages"], tools=e["tools"], add_generation_prompt=True, tokenize=False)
        return trainer_tok.encode(text, add_special_tokens=False)

    meta = {"metadata": {"task_id": "weather-paris", "run_id": "0"}}
    messages = [*EXAMPLE, {"role": "user", "content": "What is the weather in Paris?"}]
    first = smol.client.chat.completions.create(model="default", messages=messages, tools=TOOLS, tool_choice=FORCE,
                                                temperature=0, max_tokens=32, extra_body=meta).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    call = first.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    e1 = _experience(smol, first)
    assert e1["messages"] == messages and e1["tools"] == TOOLS and e1["task_id"] == "weather-paris"
    assert e1["response"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert e1["prompt_token_ids"] == trainer_ids(e1)
    # The call was sampled under its grammar: every token of it is the model's, recorded with the
    # logprob of the constrained distribution (0 where the grammar left one choice).
    assert e1["sampling"]["grammar"] and smol.tokenizer.decode(e1["response_token_ids"]).startswith("<tool_call>")
    assert max(e1["response_logprobs"]) == 0.0

    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    second = smol.client.chat.completions.create(model="default", messages=messages, tools=TOOLS, temperature=0,
                                                 max_tokens=24, extra_body=meta).choices[0]
    e2 = _experience(smol, second)
    prompt = smol.tokenizer.decode(e2["prompt_token_ids"])
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            f"{call.function.arguments}}}\n</tool_call><|im_end|>") in prompt
    assert prompt.endswith(f"<|im_start|>user\n<tool_response>\n{RESULT}\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert [m["role"] for m in e2["messages"][-3:]] == ["user", "assistant", "tool"]
    assert e2["messages"][-2]["content"] is None and e2["messages"][-2]["tool_calls"][0]["id"] == call.id
    assert e2["tools"] == TOOLS and e2["task_id"] == e1["task_id"]
    assert e2["prompt_token_ids"] == trainer_ids(e2)
    assert e2["response"]["content"] or e2["response"].get("tool_calls")  # it answered something
