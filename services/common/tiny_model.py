"""Builds the small local model that the tests and the demo use (``kaizen tiny-model PATH``).

No download: a byte-level BPE tokenizer is trained here on a synthetic corpus with the
``tokenizers`` library, a Qwen2-style chat template (with Hermes tool calls) is attached, and a
randomly initialised ``Qwen2ForCausalLM`` (head_dim 32) is saved next to it. Same seed, same bytes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# The chat template: ChatML turns, tools listed in the system turn, Hermes <tool_call> blocks.
CHAT_TEMPLATE = r"""
{%- set ns = namespace(system=none) -%}
{%- if messages and messages[0]['role'] == 'system' -%}{%- set ns.system = messages[0]['content'] -%}{%- endif -%}
{%- if tools -%}
<|im_start|>system
{{ ns.system if ns.system is not none else 'You are a helpful assistant.' }}

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif ns.system is not none -%}
<|im_start|>system
{{ ns.system }}<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if message['role'] == 'system' -%}
{%- if not loop.first -%}<|im_start|>system
{{ message['content'] }}<|im_end|>
{% endif -%}
{%- elif message['role'] == 'user' -%}
<|im_start|>user
{{ message['content'] }}<|im_end|>
{% elif message['role'] == 'assistant' -%}
<|im_start|>assistant
{% if message['content'] %}{{ message['content'] }}{% endif -%}
{%- if message.get('tool_calls') -%}
{%- for call in message['tool_calls'] -%}
{%- set fn = call['function'] if call.get('function') else call -%}
{% if message['content'] or not loop.first %}
{% endif %}<tool_call>
{"name": "{{ fn['name'] }}", "arguments": {{ fn['arguments'] if fn['arguments'] is string else fn['arguments'] | tojson }}}
</tool_call>
{%- endfor -%}
{%- endif -%}<|im_end|>
{% elif message['role'] == 'tool' -%}
<|im_start|>user
<tool_response>
{{ message['content'] }}
</tool_response><|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant
{% endif -%}
""".strip()

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added but not special: they must survive decoding so tool calls can be parsed from the text.
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<tools>", "</tools>", "<tool_response>", "</tool_response>"]

_WORDS = (
    "the a an and or but if then else when what which who how why where is are was were be "
    "yes no true false even odd number word answer question reply say repeat copy count add "
    "sum plus minus times result value name city weather today tomorrow temperature degrees "
    "search find get set list item items user assistant system tool function call arguments "
    "you i we they it this that these those here there please thanks hello hi good bad ok "
    "red green blue yellow black white cat dog bird fish tree house car book sun moon star "
    "one two three four five six seven eight nine ten zero first second last next previous "
    "left right up down in out on off of to for from with by at as into over under about "
    "python code data model train learn agent reward task run step version explorer trainer "
    "paris london tokyo berlin rome madrid cairo lima oslo seoul json key string object array"
).split()


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        kind = i % 5
        if kind == 0:
            out.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 14))) + rng.choice(".?!"))
        elif kind == 1:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            out.append(f"What is {a} plus {b}? The answer is {a + b}.")
        elif kind == 2:
            args = {rng.choice(_WORDS): rng.choice(_WORDS + [str(rng.randint(0, 99))])}
            out.append(json.dumps({"name": rng.choice(_WORDS), "arguments": args}))
        elif kind == 3:
            n = rng.randint(0, 99)
            out.append(f"Is {n} even or odd? {n} is {'even' if n % 2 == 0 else 'odd'}.")
        else:
            word = rng.choice(_WORDS).capitalize()
            out.append(f"{word}, {rng.choice(_WORDS)}: {rng.choice(_WORDS)} ({rng.randint(0, 9)}) - \"{rng.choice(_WORDS)}\"")
    return out


def build_tokenizer(seed: int = 0, vocab_size: int = 1024):
    """Train the byte-level BPE tokenizer and wrap it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits one by one, so numbers the corpus never showed still tokenize the same way.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    path: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    intermediate_size: int = 1024,
    embedding_std: float = 0.05,
    max_position_embeddings: int = 2048,
) -> Path:
    """Write tokenizer + Qwen2 model (head_dim = hidden_size / num_heads >= 32) to ``path``."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    head_dim = hidden_size // num_heads
    if head_dim < 32:
        raise ValueError(f"head_dim must be at least 32, got {head_dim}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(seed)
    tokenizer.save_pretrained(out)
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    # A random model whose (tied) embeddings are this large starts near uniform (entropy close to
    # log V) yet lets a LoRA adapter reach confident predictions: LoRA cannot grow the norms.
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, embedding_std)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    return out
