"""The hf engine's own decode step (services/explorer/serving/engines/fast_decode.py) against
transformers' and peft's forward: one step on llama, qwen2 (biases on q/k/v) and mistral decoders with
padded rows, with adapters on some rows; whole requests through the engine, long enough for the key
and value buffers to grow; and the models and adapters it leaves to transformers."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from services.explorer.serving.engines.base import AdapterRef
from services.explorer.serving.engines.fast_decode import FastDecoder
from services.explorer.serving.engines.hf import HFEngine
from tests.integration.explorer.engine_steps import drive, ids, request

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
CPU = torch.device("cpu")


def _model(kind: str, dtype: torch.dtype):
    torch.manual_seed(0)
    cls, cfg = {"llama": (LlamaForCausalLM, LlamaConfig(**SHAPE)),
                "qwen2": (Qwen2ForCausalLM, Qwen2Config(**SHAPE)),
                "mistral": (MistralForCausalLM, MistralConfig(**SHAPE, sliding_window=None))}[kind]
    model = cls(cfg).eval()
    with torch.no_grad():  # random biases, so a bias left out would show
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_()
    return model.to(dtype)


def _one_step(model, adapters_of_rows=None):
    """(transformers' logits, the fast step's logits, the cache each returned) for one decode step of
    four rows padded on the left by different amounts."""
    B, P = 4, 9
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.long)
    for b in range(B):
        mask[b, : 2 * b] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    new = torch.randint(0, 256, (B,), generator=g)
    attn = torch.cat([mask, mask.new_ones(B, 1)], 1)
    step_pos = pos[:, -1] + 1
    kwargs = {} if adapters_of_rows is None else {"adapter_names": [a or "__base__" for a in adapters_of_rows]}
    with torch.inference_mode():
        out = model(input_ids=prompt, attention_mask=mask, position_ids=pos, use_cache=True, **kwargs)
        cache = [(k, v) for k, v, *_ in out.past_key_values]
        want = model(input_ids=new[:, None], attention_mask=attn, position_ids=step_pos[:, None],
                     past_key_values=DynamicCache(ddp_cache_data=cache), use_cache=True, **kwargs)
    return want.logits[:, -1].float(), [(k, v) for k, v, *_ in want.past_key_values], (new, attn, step_pos, cache)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_step_gives_the_models_logits_and_cache(kind, dtype):
    model = _model(kind, dtype)
    want, want_cache, (new, attn, pos, cache) = _one_step(model)
    dec, why = FastDecoder.build(model, CPU, packed=False, fuse_budget=1 << 30)
    assert dec is not None, why
    assert dec.extra_bytes > 0  # q/k/v and gate/up fused
    got, got_cache = dec.step(new, attn, pos, cache, [None] * 4)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for (k, v), (wk, wv) in zip(got_cache, want_cache):
        # padding positions are whatever the prefill left there; the new token's keys and values are the model's
        torch.testing.assert_close(k, wk, rtol=tol, atol=tol)
        torch.testing.assert_close(v, wv, rtol=tol, atol=tol)


def test_products_each_on_its_own_weight_when_the_fused_copy_does_not_fit():
    model = _model("qwen2", torch.float32)
    want, _, (new, attn, pos, cache) = _one_step(model)
    dec, _ = FastDecoder.build(model, CPU, packed=False, fuse_budget=0)
    assert dec.extra_bytes == 0
    torch.testing.assert_close(dec.step(new, attn, pos, cache, [None] * 4)[0], want, rtol=1e-5, atol=1e-5)


def _peft(model, tmp_path, names=("x", "y"), **lora):
    """``model`` with LoRA adapters of random weights named ``names`` (peft's mixed-batch forward
    applies each on its rows)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    for k, name in enumerate(names):
        torch.manual_seed(10 + k)
        cfg = LoraConfig(r=4 + 2 * k, lora_alpha=8, init_lora_weights=False, **lora)
        get_peft_model(_model("qwen2", torch.float32), cfg).save_pretrained(tmp_path / name)
    peft = PeftModel.from_pretrained(model, tmp_path / names[0], adapter_name=names[0])
    for name in names[1:]:
        peft.load_adapter(tmp_path / name, adapter_name=name)
    return peft.eval()


def test_adapters_on_their_rows_give_pefts_mixed_batch(tmp_path):
    """Adapters of different ranks, one on q/v and the MLP only: each row gets its own adapter's terms
    (the base model's rows none), as peft's mixed-batch forward gives them."""
    model = _model("qwen2", torch.float32)
    peft = _peft(model, tmp_path, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    rows = ["x", None, "y", "x"]
    want, _, (new, attn, pos, cache) = _one_step(peft, rows)
    dec, _ = FastDecoder.build(model, CPU, packed=False, fuse_budget=1 << 30)
    for name in ("x", "y"):
        dec.add_adapter(name, peft)
    assert dec.refused == {} and dec.runs(rows)
    torch.testing.assert_close(dec.step(new, attn, pos, cache, rows)[0], want, rtol=1e-5, atol=1e-5)
    with peft.disable_adapter():
        base, _, _ = _one_step(peft)
    torch.testing.assert_close(want[1], base[1], rtol=1e-5, atol=1e-5)  # the base model's row is the base model's
    assert not torch.allclose(want[0], base[0], atol=1e-3)  # an adapter's is not
    dec.remove_adapter("y")
    assert not dec.runs(rows) and dec.runs(["x", None])


@pytest.mark.parametrize("lora, why", [({"use_dora": True}, "DoRA"), ({"bias": "lora_only"}, "trains biases"),
                                       ({"target_modules": ["q_proj", "embed_tokens"]}, "adapts model.embed_tokens")])
def test_adapters_it_cannot_run_are_refused_with_the_reason(tmp_path, lora, why):
    model = _model("qwen2", torch.float32)
    peft = _peft(model, tmp_path, names=("x",), **({"target_modules": "all-linear"} | lora))
    dec, _ = FastDecoder.build(model, CPU, packed=False, fuse_budget=1 << 30)
    dec.add_adapter("x", peft)
    assert why in dec.refused["x"] and not dec.runs(["x"]) and dec.runs([None])


def test_models_it_does_not_know_are_left_to_transformers():
    small = dict(SHAPE, head_dim=16)
    assert "qwen3" in FastDecoder.build(Qwen3ForCausalLM(Qwen3Config(**small)), CPU, False, 1 << 30)[1]
    assert "sliding-window" in FastDecoder.build(MistralForCausalLM(MistralConfig(**SHAPE)), CPU, False, 1 << 30)[1]
    assert "CPU" in FastDecoder.build(_model("llama", torch.float32), torch.device("meta"), False, 1 << 30)[1]


@pytest.fixture(scope="module")
def pair(tiny_model):
    """The tiny model in float32 through the engine with its own decode step and without it."""
    out = []
    for fast in (True, False):
        e = HFEngine(model_path=str(tiny_model), dtype="float32", device="cpu", max_batch_size=8, fast_decode=fast)
        e._load()
        out.append(e)
    assert out[0].fast is not None and out[1].fast is None
    return out


def _same(got, want):
    assert got.keys() == want.keys()
    for key in want:
        assert got[key][0] == want[key][0], key
        torch.testing.assert_close(torch.tensor(got[key][1]), torch.tensor(want[key][1]), rtol=0, atol=1e-4)


def test_long_requests_joined_midway_decode_as_transformers_does(pair):
    """Two requests of 150 tokens (their key and value buffers grow twice), joined after 70 steps by a
    third, and one ending early (the batch is pruned): the same tokens and logprobs as transformers'
    forward, every decode step through the fast path."""
    fast, stock = pair
    rng = random.Random(5)
    eos = fast._eos
    schedule = {0: [request("a", ids(rng, 30, eos), max_tokens=150), request("b", ids(rng, 5, eos), max_tokens=20)],
                70: [request("c", ids(rng, 12, eos), n=2, max_tokens=100)]}
    before = fast.fast_decode_steps
    got = drive(fast, schedule)
    _same(got, drive(stock, schedule))
    assert fast.fast_decode_steps - before >= 150 - 1


def test_a_batch_with_an_adapter_it_cannot_run_goes_through_peft(pair, tiny_model, tmp_path):
    """A DoRA adapter's batch takes transformers' and peft's steps (the same output as the stock
    engine; peft runs DoRA only on a batch of one adapter); a plain LoRA adapter's batch after it
    takes the fast path again."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    refs = []
    for k, (name, dora) in enumerate((("dora", True), ("plain", False))):
        torch.manual_seed(20 + k)
        base = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
        get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, use_dora=dora,
                                        target_modules="all-linear")).save_pretrained(tmp_path / name)
        refs.append(AdapterRef(agent=name, version=1, name=f"{name}-v1", int_id=k + 1, path=str(tmp_path / name)))
    fast, stock = pair
    for e in pair:
        for ref in refs:
            e._add_adapter(ref)
    assert "DoRA" in fast.fast.refused["dora-v1"] and "plain-v1" in fast.fast.adapters
    rng = random.Random(7)
    eos = fast._eos
    for ref, fast_steps in ((refs[0], False), (refs[1], True)):
        reqs = [request(f"r{k}", ids(rng, n, eos), max_tokens=6) for k, n in enumerate((11, 4))]
        for r in reqs:
            r.adapter = ref
        before = fast.fast_decode_steps
        _same(drive(fast, {0: reqs}), drive(stock, {0: reqs}))
        assert (fast.fast_decode_steps > before) == fast_steps
    for e in pair:
        for ref in refs:
            e._remove_adapter(ref)
    assert fast.fast.adapters == {} and fast.fast.refused == {}
