"""The hf engine's fast paths on a CPU (services/explorer/serving/engines/cpu_paths.py): the decode
step's attention as plain products and the linear layers on pre-packed weights give what the stock
kernels give, and the engine's outputs do not change with them."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from services.explorer.serving.engines.cpu_paths import DECODE_ATTENTION, decode_attention, pack_linears
from services.explorer.serving.engines.hf import HFEngine
from tests.integration.explorer.engine_steps import drive, ids, request


class _Attn(nn.Module):  # what transformers' attention functions read of the calling module
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal, self.layer_idx = groups, True, 0


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, None)])
@pytest.mark.parametrize("mask", ["bool", "additive", "none", "one row"])
@pytest.mark.parametrize("dv", [64, 48])
def test_decode_attention_gives_sdpas_result(dtype, tol, mask, dv):
    """One query a sequence, 9 query heads on 3 key-value heads, rows padded on the left by different
    amounts (or a mask of one row for all, or none), values as wide as the keys or narrower (as in
    multi-head latent attention): the products give SDPA's attention; in bfloat16 no further from a
    float64 reference than SDPA's own result is (times 1.5)."""
    torch.manual_seed(0)
    B, H, KV, L, D = 5, 9, 3, 37, 64
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, KV, L, D), torch.randn(B, KV, L, dv)
    seen = torch.ones(B, 1, 1, L, dtype=torch.bool)
    for b in range(B):
        seen[b, :, :, : 4 * b] = False  # row b: 4 b tokens of padding
    if mask == "one row":
        seen = seen[-1:]
    attn = {"bool": seen, "one row": seen, "none": None,
            "additive": torch.zeros(B, 1, 1, L).masked_fill(~seen, torch.finfo(torch.float32).min).to(dtype)}[mask]
    module = _Attn(H // KV)
    with torch.no_grad():
        want, _ = sdpa_attention_forward(module, q.to(dtype), k.to(dtype), v.to(dtype), attn)
        got, _ = decode_attention(module, q.to(dtype), k.to(dtype), v.to(dtype), attn, scaling=D ** -0.5)
        ref, _ = sdpa_attention_forward(module, q.double(), k.double(), v.double(), None if attn is None else seen)
    assert got.shape == want.shape == (B, 1, H, dv) and got.dtype == dtype
    if tol is not None:
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    else:
        assert (got.double() - ref).abs().max() <= 1.5 * (want.double() - ref).abs().max()


def test_decode_attention_leaves_the_rest_to_sdpa():
    """Several queries a sequence (prefill), gradients, or a model's extra (soft-capping): SDPA's
    result exactly, as transformers' own SDPA attention gives it."""
    torch.manual_seed(1)
    module = _Attn(3)
    q, k, v = torch.randn(2, 9, 6, 16), torch.randn(2, 3, 6, 16), torch.randn(2, 3, 6, 16)
    with torch.no_grad():
        assert torch.equal(decode_attention(module, q, k, v, None)[0], sdpa_attention_forward(module, q, k, v, None)[0])
    q1 = q[:, :, -1:].clone().requires_grad_()
    assert torch.equal(decode_attention(module, q1, k, v, None)[0], sdpa_attention_forward(module, q1, k, v, None)[0])
    with torch.no_grad():  # a mask with a head dimension, or an integer one: SDPA's (and its errors), not guessed at
        for odd in (torch.ones(2, 9, 1, 6, dtype=torch.bool), torch.ones(2, 1, 1, 6, dtype=torch.long)):
            try:
                want = sdpa_attention_forward(module, q[:, :, -1:], k, v, odd)[0]
            except RuntimeError as e:
                with pytest.raises(RuntimeError, match=str(e)[:20]):
                    decode_attention(module, q[:, :, -1:], k, v, odd)
            else:
                assert torch.equal(decode_attention(module, q[:, :, -1:], k, v, odd)[0], want)
    with torch.no_grad():  # a soft-capped model's call is left to transformers' SDPA attention, as without this path
        assert torch.equal(decode_attention(module, q[:, :, -1:], k, v, None, softcap=30.0)[0],
                           sdpa_attention_forward(module, q[:, :, -1:], k, v, None, softcap=30.0)[0])


def test_packed_linears_give_the_models_logits_and_step_aside_for_gradients():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(2)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    x = torch.randint(0, 256, (3, 11))
    with torch.no_grad():
        want = model(input_ids=x).logits
    assert pack_linears(model) == 2 * 7 + 1  # q k v o gate up down per layer, and the LM head
    assert pack_linears(model) == 0  # once
    with torch.no_grad():
        got = model(input_ids=x).logits
    # the same oneDNN product on a packed weight: equal bit for bit on a CPU with native bfloat16, and
    # within bfloat16's rounding where oneDNN emulates it
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
    lin = model.model.layers[0].mlp.up_proj
    with torch.no_grad():  # a weight changed in place after packing: the product of the weight as it is now
        lin.weight.mul_(2)
        h0 = torch.randn(4, 64, dtype=torch.bfloat16)
        assert torch.equal(lin(h0), nn.functional.linear(h0, lin.weight))
    h = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    out = lin(h)  # under autograd: the stock product, so gradients flow
    out.sum().backward()
    assert torch.equal(out, nn.functional.linear(h, lin.weight)) and h.grad is not None


@pytest.fixture(scope="module")
def engines(tiny_model):
    """The tiny model in float32 with the fast paths (packing forced on: float32's default is off; the
    engine's own decode step, fast_decode.py, on packed weights) and with none of them."""
    out = []
    for fast in (True, False):
        e = HFEngine(model_path=str(tiny_model), dtype="float32", device="cpu", max_batch_size=32,
                     packed_weights=fast, decode_attention=fast, fast_decode=fast)
        e._load()
        out.append(e)
    assert out[0].packed_linears > 0 and out[0].decode_attention and out[0]._base.config._attn_implementation == DECODE_ATTENTION
    assert out[0].fast is not None and out[0].fast.packed
    assert out[1].packed_linears == 0 and not out[1].decode_attention and out[1].fast is None
    return out


def test_the_engine_decodes_the_same_with_its_fast_paths(engines):
    """Greedy choices of different prompt lengths (so rows are padded), joined by more while the
    first decode: the same tokens, logprobs within float rounding."""
    fast, stock = engines
    rng = random.Random(3)
    eos = fast._eos
    schedule = {0: [request("a", ids(rng, 40, eos), max_tokens=12), request("b", ids(rng, 7, eos), n=2, max_tokens=12)],
                3: [request("c", ids(rng, 90, eos), max_tokens=10), request("d", ids(rng, 3, eos), max_tokens=10)]}
    before = fast.fast_decode_steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = drive(fast, schedule)
    assert fast.fast_decode_steps - before >= 11  # every decode step (12 tokens: the last is never fed back)
    want = drive(stock, schedule)
    assert got.keys() == want.keys() and len(got) == 5
    for key in want:
        assert got[key][0] == want[key][0], key
        torch.testing.assert_close(torch.tensor(got[key][1]), torch.tensor(want[key][1]), rtol=0, atol=1e-4)
    ops = {e.key: e.count for e in prof.key_averages()}
    sdpa = sum(n for k, n in ops.items() if "scaled_dot_product" in k and k.startswith("aten::_"))
    layers = fast._base.config.num_hidden_layers
    assert ops.get("mkldnn::_linear_pointwise", 0) > 0  # the packed products ran ...
    assert 0 < sdpa <= 2 * layers  # ... and SDPA only in the two prefills, not in the ~12 decode steps


def test_a_prompt_sent_again_prefills_one_token_through_the_decode_path(engines):
    """The same prompt twice: the second time the prefix cache holds all of it but its last token,
    whose prefill is one query over cached keys (the decode path): the same output as the stock engine."""
    fast, stock = engines
    rng = random.Random(6)
    prompt = ids(rng, 50, fast._eos)
    for e in engines:
        e._prefix.clear()
        drive(e, {0: [request("first", prompt, max_tokens=6)]})
    reused = fast._prefix.tokens_reused
    got, want = drive(fast, {0: [request("again", prompt, max_tokens=6)]}), drive(stock, {0: [request("again", prompt, max_tokens=6)]})
    assert fast._prefix.tokens_reused - reused == len(prompt) - 1
    assert got[("again", 0)][0] == want[("again", 0)][0]
    torch.testing.assert_close(torch.tensor(got[("again", 0)][1]), torch.tensor(want[("again", 0)][1]), rtol=0, atol=1e-4)


def test_packed_weights_are_refused_off_the_cpu(tiny_model):
    from services.explorer.serving.engines.base import EngineError

    with pytest.raises(EngineError, match="packed_weights is for the CPU"):
        HFEngine(model_path=str(tiny_model), device="meta", packed_weights=True)


def _random_adapter(model_path, folder, seed: int) -> str:
    """A LoRA adapter with random (non-zero) weights on every linear layer of the tiny model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=16, init_lora_weights=False, target_modules="all-linear")
    get_peft_model(base, cfg).save_pretrained(folder)
    return str(folder)


def test_adapters_on_packed_weights_decode_the_same(engines, tiny_model, tmp_path):
    """Two adapters and the base model in one batch (peft's mixed-adapter forward calls each packed
    linear layer as its base layer): the same tokens and logprobs as the stock kernels, and the
    adapters do change the output."""
    from services.explorer.serving.engines.base import AdapterRef

    refs = [AdapterRef(agent=a, version=1, name=f"{a}-v1", int_id=k + 1, path=_random_adapter(str(tiny_model), tmp_path / a, k))
            for k, a in enumerate(("x", "y"))]
    fast, stock = engines
    for e in engines:
        for ref in refs:
            e._add_adapter(ref)
    rng = random.Random(4)
    eos = fast._eos
    prompts = [ids(rng, n, eos) for n in (20, 33, 9)]

    def schedule(adapters):
        reqs = [request(f"r{k}", p, max_tokens=8) for k, p in enumerate(prompts)]
        for r, a in zip(reqs, adapters):
            r.adapter = a
        return {0: reqs}

    mixed = schedule([refs[0], refs[1], None])
    before = fast.fast_decode_steps
    got, want = drive(fast, mixed), drive(stock, mixed)
    assert fast.fast_decode_steps - before >= 7 and fast.fast.refused == {}  # mixed adapters' steps take the fast path
    for key in want:
        assert got[key][0] == want[key][0], key
        torch.testing.assert_close(torch.tensor(got[key][1]), torch.tensor(want[key][1]), rtol=0, atol=1e-4)
    base = drive(stock, schedule([None, None, None]))
    assert base[("r2", 0)][0] == want[("r2", 0)][0]  # the base model's row is the base model's
    assert not torch.allclose(torch.tensor(base[("r0", 0)][1]), torch.tensor(want[("r0", 0)][1]), atol=1e-3)  # an adapter's is not


def test_forced_packing_that_onednn_refuses_is_a_clear_error(tiny_model):
    """float16 on this CPU: either oneDNN packs it (then the engine runs) or the engine refuses to
    start with an error naming the option, never a raw kernel error mid-request."""
    from services.explorer.serving.engines.base import EngineError

    e = HFEngine(model_path=str(tiny_model), dtype="float16", device="cpu", packed_weights=True)
    try:
        e._load()
    except EngineError as err:
        assert "engine.packed_weights" in str(err)
    else:
        assert e.packed_linears > 0
