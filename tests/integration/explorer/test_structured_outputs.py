"""Structured outputs on a real Explorer (hf engine, tiny random model) through the openai client:
response_format json_object / json_schema and tool_choice required / named are enforced by
constrained decoding, so even a model that knows nothing answers in the asked shape. The record
keeps the grammar, and its logprobs are those of the constrained distribution (0 where the grammar
left one token), which is what the Trainer recomputes."""

from __future__ import annotations

import json

import openai
import pytest

pytestmark = pytest.mark.integration

USER = [{"role": "user", "content": "Is 17 even or odd?"}]
VERDICT = {"type": "object", "properties": {"parity": {"type": "string", "enum": ["even", "odd"]},
                                            "sure": {"type": "boolean"}}, "required": ["parity", "sure"]}
TOOLS = [
    {"type": "function", "function": {"name": "check", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"]}}},
    {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"key": {"type": "string", "enum": ["a", "b"]}}, "required": ["key"]}}},
]


@pytest.fixture
def tools_explorer(make_explorer):
    return make_explorer("model.chat_template=hermes-tools")


def _record(ex, choice) -> dict:
    return ex.http.get(f"/experiences/{choice.model_extra['experience_id']}").json()


def test_json_schema_answers_match_the_schema(explorer):
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT, "strict": True}}
    r = explorer.client.chat.completions.create(model="default", messages=USER, response_format=fmt, n=4, seed=3,
                                                max_tokens=40, temperature=1.5)
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        answer = json.loads(c.message.content)
        assert set(answer) == {"parity", "sure"} and answer["parity"] in ("even", "odd") and isinstance(answer["sure"], bool)
    rec = _record(explorer, r.choices[0])
    assert rec["sampling"]["grammar"] and rec["finish_reason"] == "stop"
    # '{"parity": "' is forced; so is everything between the enum value and the boolean
    forced = [lp for lp in rec["response_logprobs"] if lp == 0.0]
    assert len(forced) >= 3 and all(lp <= 0.0 for lp in rec["response_logprobs"])


def test_json_object_streams_valid_json_or_says_it_was_cut(explorer):
    stream = explorer.client.chat.completions.create(model="default", messages=USER, stream=True, max_tokens=60,
                                                     response_format={"type": "json_object"}, seed=1)
    text, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text.startswith("{")
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert finish == "length"


def test_tool_choice_required_and_named_always_give_a_valid_call(tools_explorer):
    ex = tools_explorer
    for choice, names in (("required", {"check", "lookup"}), ({"type": "function", "function": {"name": "lookup"}}, {"lookup"})):
        r = ex.client.chat.completions.create(model="default", messages=USER, tools=TOOLS, tool_choice=choice, n=4,
                                              seed=5, max_tokens=60, temperature=1.5, parallel_tool_calls=False)
        for c in r.choices:
            assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c.message.content
            call = c.message.tool_calls[0].function
            args = json.loads(call.arguments)
            assert call.name in names
            if call.name == "check":
                assert set(args) == {"n"} and 0 <= args["n"] <= 99
            else:
                assert args in ({"key": "a"}, {"key": "b"})
        rec = _record(ex, r.choices[0])
        assert ex.tokenizer.decode(rec["response_token_ids"]).startswith("<tool_call>")  # sampled, not a prompt prefix
        assert rec["response"]["tool_calls"][0]["function"]["name"] in names


@pytest.mark.parametrize("fmt, param", [
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": "zero"}}}, "response_format"),
])
def test_bad_response_formats_get_a_400_naming_them(explorer, fmt, param):
    with pytest.raises(openai.BadRequestError) as e:
        explorer.client.chat.completions.create(model="default", messages=USER, response_format=fmt, max_tokens=4)
    assert e.value.body["param"] == param


def test_the_trainer_scores_constrained_tokens_as_the_engine_sampled_them(explorer, tiny_model):
    """The Trainer rebuilds the engine's masks from the recorded grammar: its logprobs for a
    constrained response (no adapter trained yet: the served model) equal the recorded ones, so
    importance ratios start at 1. Scored without the masks they would not (forced tokens have a
    recorded logprob of 0), and a gradient through the masked entropy stays finite."""
    import torch

    from services.common.records import CommittedExperience
    from services.trainer.batches import to_item
    from services.trainer.config import LoraSection
    from services.trainer.policy import Policy, pack

    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}}
    r = explorer.client.chat.completions.create(model="default", messages=USER, response_format=fmt, n=3, seed=2,
                                                max_tokens=40, temperature=0.8)
    plain = explorer.client.chat.completions.create(model="default", messages=USER, max_tokens=8, temperature=0.8)
    fields = CommittedExperience.__dataclass_fields__
    rows = [{**{k: v for k, v in _record(explorer, c).items() if k in fields}, "seq": k, "reward": 1.0}
            for k, c in enumerate([*r.choices, *plain.choices])]
    items = [to_item(CommittedExperience(**row), 1.0) for row in rows]
    assert [bool(i.grammar) for i in items] == [True, True, True, False]

    policy = Policy(model_path=str(tiny_model), dtype="float32", device="cpu", lora=LoraSection(r=8, alpha=16))
    policy.add_agent("default", critic=False)
    batch = pack([i.prompt_ids for i in items], [i.response_ids for i in items], [i.temperature for i in items], policy.pad_id)
    allowed = policy.allowed_tokens([i.grammar for i in items], [i.response_ids for i in items], batch.response_len)
    mask = batch.response_mask.bool()
    recorded = torch.zeros_like(batch.response_mask)
    for row, it in enumerate(items):
        recorded[row, : len(it.old_logprobs)] = torch.tensor(it.old_logprobs)
    out = policy.forward(batch, need_hidden=False, allowed=allowed, entropy_grad=True)
    torch.testing.assert_close(out.logprobs[mask], recorded[mask], atol=2e-4, rtol=1e-4)
    unmasked = policy.forward(batch, need_hidden=False).logprobs.detach()
    assert (unmasked[:3][mask[:3]] - recorded[:3][mask[:3]]).abs().max() > 0.1
    torch.testing.assert_close(unmasked[3][mask[3]], recorded[3][mask[3]], atol=2e-4, rtol=1e-4)  # plain rows unchanged
    (out.logprobs[mask].sum() + out.entropy[mask].sum()).backward()
    grads = [q.grad for q in policy.adapter_parameters("default") if q.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
