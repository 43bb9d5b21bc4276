"""The built-in hermes-tools template (tools, calls with null content, tool results) and the shared loader."""

from __future__ import annotations

import json

import pytest

from services.common.chat_templates import load_tokenizer, resolve_chat_template
from services.common.config import ConfigError, ModelSection, load_config
from services.common.tiny_model import CHAT_TEMPLATE, build_tokenizer
from services.explorer.config import ExplorerConfig
from services.common.grammar import GrammarCache
from services.common.tool_calls import call_grammar, parse_tool_calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALLS = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
         {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "25C, clear"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A model directory holding only the tiny tokenizer (whose own template is the tiny model's)."""
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(seed=0).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir, "hermes-tools")


def _assistant_turns(text: str) -> list[str]:
    return [t.split("<|im_end|>")[0] for t in text.split("<|im_start|>assistant\n")[1:]]


def test_renders_tools_a_call_with_null_content_and_tool_results(tok):
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in system
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system
    call = _assistant_turns(text)[0]
    assert call == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    # both results in one user turn, then the generation prompt
    assert text.endswith("<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response>\n"
                         "<tool_response>\n25C, clear\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert "None" not in text


def test_rendered_calls_parse_back_to_the_same_calls(tok):
    for content in (None, "Let me check."):
        messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": content, "tool_calls": CALLS}]
        turn = _assistant_turns(tok.apply_chat_template(messages, tools=TOOLS, tokenize=False))[0]
        parsed_content, calls = parse_tool_calls(turn)
        assert parsed_content == content
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]


def test_rendered_calls_are_what_tool_choice_decodes_under(tok):
    """A forced call (tool_choice) and a call rendered back into the next prompt look the same: the
    rendered assistant turn matches the grammar of a named, required or parallel choice, token for
    token; other text, another tool, or arguments outside the tool's schema do not."""
    cache = GrammarCache(tok, len(tok), stop_token_ids=[tok.convert_tokens_to_ids("<|im_end|>")])

    def matches(ebnf, text):
        m = cache.matcher(ebnf)
        return all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_completed()

    def turn(calls):
        messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": calls}]
        return _assistant_turns(tok.apply_chat_template(messages, tools=TOOLS, tokenize=False))[0]

    one, two = turn(CALLS[:1]), turn(CALLS)
    named = call_grammar(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, parallel=False)
    required, parallel = call_grammar(TOOLS, "required", parallel=False), call_grammar(TOOLS, "required", parallel=True)
    assert matches(named, one) and matches(required, one) and matches(parallel, one) and matches(parallel, two)
    assert not matches(required, two)  # one call only without parallel_tool_calls
    assert not matches(required, "It is sunny.")
    assert not matches(required, one.replace('"get_weather"', '"get_time"'))
    assert not matches(required, one.replace('{"city": ', '{"town": '))
    assert call_grammar(TOOLS, "auto", parallel=True) is None


def test_plain_chat_adds_no_system_turn(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    text = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "hello"}], tokenize=False)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"


def test_the_shared_loader_applies_the_override(model_dir, tmp_path):
    assert load_tokenizer(model_dir).chat_template == CHAT_TEMPLATE  # no override: the model's own
    assert load_tokenizer(model_dir, "hermes-tools").chat_template == resolve_chat_template("hermes-tools")
    mine = tmp_path / "mine.jinja"
    mine.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    section = ModelSection(path=str(model_dir), chat_template=str(mine))
    tok = load_tokenizer(section)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[user] hi\n"
    assert load_tokenizer(section, "hermes-tools").chat_template == resolve_chat_template("hermes-tools")  # the argument wins


def test_unknown_template_is_a_config_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="model.chat_template 'chatml-nope' is neither a built-in template"):
        resolve_chat_template("chatml-nope")
    with pytest.raises(ConfigError, match="model.chat_template") as e:
        load_config(ExplorerConfig, None, ["model.path=/m", f"model.chat_template={tmp_path}/missing.jinja"], env={})
    assert "hermes-tools" in str(e.value)  # says which names exist
    cfg = load_config(ExplorerConfig, None, ["model.path=/m", "model.chat_template=hermes-tools"], env={})
    assert cfg.model.chat_template == "hermes-tools"
