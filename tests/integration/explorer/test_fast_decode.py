"""The hf engine's own decode step (services/explorer/serving/engines/fast_decode.py) against
transformers' and peft's forward: one step on llama, qwen2 (biases on q/k/v) and mistral decoders with
padded rows, with adapters on some rows; whole requests through the engine, long enough for the key
and value buffers to grow; the models and adapters it leaves to transformers; and the products of
bfloat16 steps on our own kernels (engines/decode_kernels.py), where this CPU runs them."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from services.common.models import cpu_flags
from services.explorer.serving.engines import decode_kernels
from services.explorer.serving.engines.base import AdapterRef, EngineError
from services.explorer.serving.engines.fast_decode import FastDecoder
from services.explorer.serving.engines.hf import HFEngine
from tests.integration.explorer.engine_steps import drive, ids, request

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
CPU = torch.device("cpu")


def _model(kind: str, dtype: torch.dtype, shape: dict = SHAPE):
    torch.manual_seed(0)
    cls, cfg = {"llama": (LlamaForCausalLM, LlamaConfig(**shape)),
                "qwen2": (Qwen2ForCausalLM, Qwen2Config(**shape)),
                "mistral": (MistralForCausalLM, MistralConfig(**shape, sliding_window=None))}[kind]
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
    assert len(got_cache) == len(want_cache) == 2
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


def _peft(model, tmp_path, names=("x", "y"), shape: dict = SHAPE, **lora):
    """``model`` (a qwen2 of ``shape``) with LoRA adapters of random weights named ``names`` (peft's
    mixed-batch forward applies each on its rows)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    for k, name in enumerate(names):
        torch.manual_seed(10 + k)
        cfg = LoraConfig(r=4 + 2 * k, lora_alpha=8, init_lora_weights=False, **lora)
        get_peft_model(_model("qwen2", torch.float32, shape), cfg).save_pretrained(tmp_path / name)
    peft = PeftModel.from_pretrained(model, tmp_path / names[0], adapter_name=names[0])
    for name in names[1:]:
        peft.load_adapter(tmp_path / name, adapter_name=name)
    return peft.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adapters_on_their_rows_give_pefts_mixed_batch(tmp_path, dtype):
    """Adapters of different ranks, on q/v and the MLP only: each row gets its own adapter's terms
    (the base model's rows none), as peft's mixed-batch forward gives them; in bfloat16 (the adapters in
    the model's dtype, as the engine holds them) within bfloat16's rounding."""
    model = _model("qwen2", dtype)
    peft = _peft(model, tmp_path, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    if dtype != torch.float32:
        for param_name, param in peft.named_parameters():
            if "lora_" in param_name:
                param.data = param.data.to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    rows = ["x", None, "y", "x"]
    want, _, (new, attn, pos, cache) = _one_step(peft, rows)
    dec, _ = FastDecoder.build(model, CPU, packed=False, fuse_budget=1 << 30)
    for name in ("x", "y"):
        dec.add_adapter(name, peft)
    assert dec.refused == {} and not dec.disabled and dec.runs(rows)
    torch.testing.assert_close(dec.step(new, attn, pos, cache, rows)[0], want, rtol=tol, atol=tol)
    with peft.disable_adapter():
        base, _, _ = _one_step(peft)
    torch.testing.assert_close(want[1], base[1], rtol=tol, atol=tol)  # the base model's row is the base model's
    assert not torch.allclose(want[0], base[0], atol=1e-3)  # an adapter's is not
    dec.remove_adapter("y")
    assert not dec.runs(rows) and dec.runs(["x", None])


@pytest.mark.parametrize("lora, why", [({"use_dora": True}, "DoRA"), ({"bias": "lora_only"}, "trains biases"),
                                       ({"target_modules": ["q_proj", "embed_tokens"]}, "adapts model.embed_tokens"),
                                       ({"trainable_token_indices": [3, 5]}, "trainable tokens")])
def test_adapters_it_cannot_run_are_refused_with_the_reason(tmp_path, lora, why):
    model = _model("qwen2", torch.float32)
    peft = _peft(model, tmp_path, names=("x",), **({"target_modules": "all-linear"} | lora))
    dec, _ = FastDecoder.build(model, CPU, packed=False, fuse_budget=1 << 30)
    dec.add_adapter("x", peft)
    assert why in dec.refused["x"] and not dec.runs(["x"]) and dec.runs([None])


def test_base_weights_changed_by_an_adapters_load_turn_it_off(tmp_path):
    """An adapter whose loading rewrites the base model's weights (PiSSA-style initialisations do): every
    product here was built from the old weights, so the path runs nothing from then on."""
    model = _model("qwen2", torch.float32)
    dec, _ = FastDecoder.build(model, CPU, packed=False, fuse_budget=1 << 30)
    peft = _peft(model, tmp_path, names=("x",), target_modules="all-linear")
    dec.add_adapter("x", peft)
    assert not dec.disabled and dec.runs(["x", None])  # a plain adapter's load leaves them as they were
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.base_layer.weight.mul_(2)
    dec.add_adapter("x", peft)
    assert "weights changed" in dec.disabled and not dec.runs([None])


def test_models_it_does_not_know_are_left_to_transformers():
    small = dict(SHAPE, head_dim=16)
    assert "qwen3" in FastDecoder.build(Qwen3ForCausalLM(Qwen3Config(**small)), CPU, False, 1 << 30)[1]
    assert "sliding-window" in FastDecoder.build(MistralForCausalLM(MistralConfig(**SHAPE)), CPU, False, 1 << 30)[1]
    assert "CPU" in FastDecoder.build(_model("llama", torch.float32), torch.device("meta"), False, 1 << 30)[1]

    class Quantized(torch.nn.Linear):
        pass

    odd = _model("llama", torch.float32)
    odd.lm_head = Quantized(64, 256, bias=False)
    assert "not plain nn.Linear" in FastDecoder.build(odd, CPU, False, 1 << 30)[1]


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


@pytest.fixture
def no_eos(pair):
    """Requests end at their max_tokens alone (the tiny model's greedy choices could end one early)."""
    eos = [e._eos for e in pair]
    for e in pair:
        e._eos = set()
    yield eos[0]
    for e, s in zip(pair, eos):
        e._eos = s


def test_long_requests_joined_midway_decode_as_transformers_does(pair, no_eos):
    """A request of 150 tokens (its key and value buffers grow twice), one of 20 (the batch is pruned
    when it ends), two choices of a third joining at step 70 (merged into the batch): the same tokens
    and logprobs as transformers' forward, every decode step through the fast path."""
    fast, stock = pair
    rng = random.Random(5)
    schedule = {0: [request("a", ids(rng, 30, no_eos), max_tokens=150), request("b", ids(rng, 5, no_eos), max_tokens=20)],
                70: [request("c", ids(rng, 12, no_eos), n=2, max_tokens=100)]}
    before, allocations = fast.fast_decode_steps, fast.fast.allocations
    got = drive(fast, schedule)
    _same(got, drive(stock, schedule))
    assert [len(got[k][0]) for k in (("a", 0), ("b", 0), ("c", 0), ("c", 1))] == [150, 20, 100, 100]
    assert fast.fast_decode_steps - before == 170 - 1  # steps 0-169 decode, but the last (nothing left to feed)
    # the first step, the prune at step 20, the growth past 30 + 1 + 64 tokens, the merge at step 70, the growth after it
    assert fast.fast.allocations - allocations >= 5


def test_a_batch_switches_to_transformers_and_back_as_an_adapter_it_cannot_run_comes_and_goes(pair, no_eos, tiny_model, tmp_path):
    """A request on an adapter that trains biases (transformers and peft run its batches) joins a batch
    on the base model and leaves it: the steps before and after it take the fast path, the ones
    beside it do not, and every token and logprob is the stock engine's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(30)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, bias="lora_only",
                                    target_modules="all-linear")).save_pretrained(tmp_path / "biased")
    ref = AdapterRef(agent="biased", version=1, name="biased-v1", int_id=9, path=str(tmp_path / "biased"))
    fast, stock = pair
    for e in pair:
        e._add_adapter(ref)
    try:
        assert "biases" in fast.fast.refused["biased-v1"]
        rng = random.Random(8)
        joined = request("j", ids(rng, 9, no_eos), max_tokens=10)
        joined.adapter = ref
        schedule = {0: [request("long", ids(rng, 20, no_eos), max_tokens=40)], 10: [joined]}
        before = fast.fast_decode_steps
        _same(drive(fast, schedule), drive(stock, schedule))
        # 39 decode steps (the last token is never fed back), 9 of them beside the joined request (it samples
        # its 10 tokens at steps 10-19 and leaves before step 19's decode)
        assert fast.fast_decode_steps - before == 39 - 9
    finally:
        for e in pair:
            e._remove_adapter(ref)


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


def test_a_failing_fast_step_falls_back_to_transformers_for_good(pair, tiny_model, caplog):
    """Should the fast step ever raise, that step and every later one run through transformers: the
    requests get the stock engine's tokens, and the failure is logged once, not sent to them."""
    _, stock = pair
    e = HFEngine(model_path=str(tiny_model), dtype="float32", device="cpu", max_batch_size=8)
    e._load()

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the fast path")

    e.fast.step = broken
    rng = random.Random(9)
    schedule = {0: [request("a", ids(rng, 15, e._eos), max_tokens=8), request("b", ids(rng, 6, e._eos), max_tokens=8)]}
    with caplog.at_level("ERROR"):
        _same(drive(e, schedule), drive(stock, schedule))
    assert e.fast is None and e.fast_decode_steps == 0
    assert sum("fast decode failed" in r.message for r in caplog.records) == 1


# ---------------------------------------------------------------------- engines/decode_kernels.py

needs_kernel = pytest.mark.skipif(decode_kernels.unsupported() is not None, reason=f"decode_kernels do not run here: {decode_kernels.unsupported()}")


@pytest.fixture(scope="module")
def kernels():
    """The built kernels: on a CPU that runs them, a failed build is a failure, with its reason."""
    mod, why = decode_kernels.load()
    assert mod is not None, why
    return mod


def _products_match(packed, w, bias, rows: range) -> None:
    for m in rows:
        x = torch.randn(m, w.shape[1], dtype=torch.bfloat16)
        got, want = packed(x), torch.nn.functional.linear(x, w, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (m, w.shape[0])
        exact = x.double() @ w.double().T + (bias.double() if bias is not None else 0)
        step = want.float().abs().clamp(min=1e-3) * 2**-7  # one bfloat16 step at that magnitude
        assert ((got.float() - want.float()).abs() <= step).all(), m
        assert (got == want).float().mean() > 0.99, m
        assert ((got.double() - exact).abs() <= step * 1.01).all(), m  # both are the exact sum, rounded once


@needs_kernel
@pytest.mark.parametrize("n, k", [(960, 576), (50, 101), (17, 32), (50, 64)])
def test_the_kernels_products_are_onednns(kernels, n, k):
    """1 to 8 rows (to 32 on AMX where the inputs are a multiple of 32), outputs not a multiple of 16,
    an odd number of inputs, with and without a bias: float32 sums rounded once to bfloat16, as oneDNN's
    products give them (they may differ by the order of the sums: one bfloat16 step at most, and rarely)."""
    mod = kernels
    torch.manual_seed(0)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16)
    for bias in (None, b):
        packed = decode_kernels.Packed(mod, w, bias)
        assert packed.rows == (32 if decode_kernels.amx() and k % 32 == 0 else 8)
        _products_match(packed, w, bias, range(1, packed.rows + 1))
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        packed(torch.randn(packed.rows + 1, k, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        packed(torch.randn(1, k))
    for wrong in (k - 1, k + 1, k + 2):  # one input more or fewer: refused, not padded or dropped
        with pytest.raises(RuntimeError, match="does not match"):
            packed(torch.randn(1, wrong, dtype=torch.bfloat16))


@needs_kernel
@pytest.mark.skipif("amx_tile" not in cpu_flags(), reason="this CPU has no AMX")
def test_on_amx_every_row_count_runs_on_its_tiles_and_matches_onednn(kernels):
    """AMX's products from one row on (the default leaves 1-2 rows to AVX-512 BF16): one tile of rows
    and two, a last group of fewer than four blocks of outputs, outputs not a multiple of 16."""
    assert decode_kernels.amx(), "this CPU has AMX but the kernels did not get its tiles"
    torch.manual_seed(1)
    w, b = torch.randn(6 * 16 + 5, 96, dtype=torch.bfloat16), torch.randn(6 * 16 + 5, dtype=torch.bfloat16)
    kernels.set_amx_min_rows(1)
    try:
        for bias in (None, b):
            _products_match(decode_kernels.Packed(kernels, w, bias), w, bias, range(1, 33))
    finally:
        kernels.set_amx_min_rows(decode_kernels.AMX_MIN_ROWS)
    with pytest.raises(RuntimeError, match="1 to 33"):
        kernels.set_amx_min_rows(34)


@needs_kernel
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_bfloat16_step_on_the_kernels_gives_the_models_logits(kernels, kind):
    """In bfloat16 the step runs on the kernels (counted): products of batches of up to 8 rows,
    attention, norms (with the residual sums), rotary embedding (heads of 32: a multiple of 32, as the
    rotary kernel takes), SiLU(gate) * up;
    it gives what transformers' forward gives, as closely as the step without them."""
    model = _model(kind, torch.bfloat16, dict(SHAPE, hidden_size=128))
    want, want_cache, (new, attn, pos, cache) = _one_step(model)
    on, why = FastDecoder.build(model, CPU, packed=True, fuse_budget=1 << 30)
    off, _ = FastDecoder.build(model, CPU, packed=True, fuse_budget=1 << 30, kernels=False)
    assert on.kernel == "" and off.kernel == "engine.decode_kernels is false", why
    assert on._kattention and on._krope and on._krms and on._ksilu
    products = "products at 1-32 rows (3-32 on AMX)" if decode_kernels.amx() else "products at 1-8 rows"
    assert on.kernels_note() == products + ", attention, norms, rotary embedding, SiLU"
    assert on.extra_bytes > off.extra_bytes  # the products' copy of the weights
    got, got_cache = on.step(new, attn, pos, [(k.clone(), v.clone()) for k, v in cache], [None] * 4)
    assert on.kernel_steps == 1 and off.kernel_steps == 0
    ref, ref_cache = off.step(new, attn, pos, cache, [None] * 4)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert (got - want).abs().max() <= (ref - want).abs().max() + 2e-2
    for (k, v), (rk, rv) in zip(got_cache, ref_cache):  # the same keys and values written
        torch.testing.assert_close(k[:, :, -1], rk[:, :, -1], rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(v[:, :, -1], rv[:, :, -1], rtol=2e-2, atol=2e-2)


@needs_kernel
def test_the_layers_in_one_call_are_the_same_kernels_called_layer_by_layer(kernels, tmp_path):
    """On the kernels a step's layers run as one call (decode_kernels.DecodeLayers): bit for bit the logits
    and the keys and values that the same kernels give called a layer at a time from Python, on the base
    model's rows, adapters of two ranks on theirs (each on its own rows), and one adapter on every row;
    and, with adapters, what peft's mixed-batch forward gives."""
    shape = dict(SHAPE, hidden_size=128)
    model = _model("qwen2", torch.bfloat16, shape)
    peft = _peft(model, tmp_path, shape=shape, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    for param_name, param in peft.named_parameters():
        if "lora_" in param_name:
            param.data = param.data.to(torch.bfloat16)
    dec, _ = FastDecoder.build(model, CPU, packed=True, fuse_budget=1 << 30)
    for name in ("x", "y"):
        dec.add_adapter(name, peft)
    assert dec._klayers is not None and dec._klayers.layers() == 2 and dec._klayers_rows >= 8
    for rows in ([None] * 4, ["x", None, "y", "x"], ["y"] * 4):
        want, _, (new, attn, pos, cache) = _one_step(peft, rows)
        got, got_cache = dec.step(new, attn, pos, cache, rows)
        one_call = dec._klayers
        dec._klayers = None  # the same step a layer at a time
        try:
            ref, ref_cache = dec.step(new, attn, pos, cache, rows)
        finally:
            dec._klayers = one_call
        assert torch.equal(got, ref), rows
        assert len(got_cache) == 2 and all(torch.equal(k, rk) and torch.equal(v, rv) for (k, v), (rk, rv) in zip(got_cache, ref_cache))
        assert got_cache[0][0].shape == cache[0][0].shape[:2] + (cache[0][0].shape[2] + 1, cache[0][0].shape[3])
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    dec.remove_adapter("y")  # its terms go with it
    assert "y" not in dec._klora and not dec.runs(["y"])


@needs_kernel
def test_the_kernels_sampler_draws_what_the_engines_torch_sampler_draws(kernels):
    """decode_kernels.sample against the engine's sampler in torch (the log-softmax of the logits over
    the temperature, the most likely token at temperature 0, else the two-level inverse CDF at u):
    temperatures 1, 0.7, 1.3 and 0, vocabularies that are and are not multiples of 16 and 256, rows with
    most tokens masked off (a grammar's -inf) or all but one: the same tokens for the same u, their
    log-probabilities within float32's rounding."""
    from services.explorer.serving.engines.hf import _inverse_cdf

    g = torch.Generator().manual_seed(0)
    temps = torch.tensor([1.0, 0.7, 0.0, 1.0, 1.3, 0.0])
    for V in (49152, 1000, 77, 1):
        logits = torch.randn(6, V, generator=g) * 4
        logits[3, 5:] = float("-inf")  # five tokens allowed
        logits[4, : V - 1] = float("-inf")  # only the last
        for _ in range(50):
            u = torch.rand(6, generator=g)
            tokens, logps = kernels.sample(logits, temps, u)
            logp = (logits / torch.where(temps <= 0, 1.0, temps)[:, None]).log_softmax(-1)
            want = torch.where(temps <= 0, logp.argmax(-1), _inverse_cdf(logp.exp(), u))
            assert torch.equal(tokens, want), (V, u)
            torch.testing.assert_close(logps, logp.gather(-1, want[:, None])[:, 0], rtol=1e-5, atol=1e-5)
        assert (tokens[3] < 5) and tokens[4] == V - 1
    with pytest.raises(RuntimeError, match="float32 logits"):
        kernels.sample(torch.zeros(2, 8, dtype=torch.float64), temps[:2], temps[:2])
    with pytest.raises(RuntimeError, match="a temperature and a u a row"):
        kernels.sample(torch.zeros(2, 8), temps[:3], temps[:2])


def _one_bf16_step(x: torch.Tensor) -> torch.Tensor:
    return x.float().abs().clamp(min=1e-3) * 2**-7  # one bfloat16 step at x's magnitude


@needs_kernel
@pytest.mark.parametrize("B, H, KV, D, T", [(1, 9, 3, 64, 40), (5, 4, 2, 32, 17), (3, 8, 1, 16, 9), (2, 8, 8, 128, 70),
                                             # head shapes compiled for: 4, 2, 1 and 5 query heads of 64, 2 of 128
                                             (4, 8, 2, 64, 50), (2, 4, 2, 64, 9), (3, 4, 4, 64, 33), (1, 10, 2, 64, 17),
                                             (3, 4, 2, 128, 16)])
def test_the_kernels_attention_is_the_float32_products(kernels, B, H, KV, D, T):
    """Queries as a view into the fused product's output, key and value buffers with room past T,
    rows padded on the left: the float32 products the step computes without the kernel (and the exact
    sums, rounded once), within one bfloat16 step and almost always equal."""
    mod = kernels
    torch.manual_seed(B * 100 + D)
    qkv = torch.randn(B, H + 2 * KV, D, dtype=torch.bfloat16)
    q = qkv[:, :H]
    k, v = (torch.randn(B, KV, T + 7, D, dtype=torch.bfloat16) for _ in range(2))
    keep = torch.ones(B, T, dtype=torch.bool)
    for b in range(B):
        keep[b, : 3 * b] = False
    scale = D ** -0.5
    bias = torch.zeros(B, T).masked_fill_(~keep, float("-inf")).view(B, 1, 1, T).expand(B, KV, 1, T).reshape(B * KV, 1, T)
    scores = torch.baddbmm(bias, q.reshape(B * KV, H // KV, D).float(),
                           k[:, :, :T].float().reshape(B * KV, T, D).transpose(1, 2), alpha=scale)
    exact = torch.bmm(torch.softmax(scores.double(), -1), v[:, :, :T].double().reshape(B * KV, T, D)).view(B, H * D)
    want = torch.bmm(torch.softmax(scores, -1), v[:, :, :T].float().reshape(B * KV, T, D)).view(B, H * D).to(torch.bfloat16)
    got = mod.attention(q, k, v, keep, scale)
    assert got.dtype == torch.bfloat16 and got.shape == (B, H * D)
    assert ((got.float() - want.float()).abs() <= _one_bf16_step(want)).all()
    assert (got == want).float().mean() > 0.99
    assert ((got.double() - exact).abs() <= _one_bf16_step(exact) * 1.01).all()
    with pytest.raises(RuntimeError, match="query heads a key-value head"):
        mod.attention(torch.randn(B, 9 * KV, D).to(torch.bfloat16), k, v, keep, scale)
    with pytest.raises(RuntimeError, match="bool"):
        mod.attention(q, k, v, keep.long(), scale)


@needs_kernel
def test_the_kernels_norm_silu_and_rotary_embedding_are_torchs(kernels):
    """The rotary embedding and the cache's writes bit for bit, the residual sum too; the norm and
    SiLU(gate) * up but for a rare rounding."""
    mod = kernels
    torch.manual_seed(3)
    for B, N in ((1, 576), (7, 64), (33, 128)):
        x = (torch.randn(B, N) * 3).to(torch.bfloat16)
        w = torch.randn(N).to(torch.bfloat16)
        want = w * torch.nn.functional.rms_norm(x.float(), (N,), eps=1e-5).to(torch.bfloat16)
        got = mod.rms_norm(x, w, 1e-5)
        # the mean of squares is summed in another order than torch's: a rounding apart, rarely
        assert (got == want).float().mean() > 0.999 and ((got.float() - want.float()).abs() <= _one_bf16_step(want)).all()
        delta = torch.randn(N, B).to(torch.bfloat16).t()  # not contiguous
        for a, b in ((x, delta), (x, x)):
            total, normed = mod.add_rms_norm(a, b, w, 1e-5)
            want = w * torch.nn.functional.rms_norm((a + b).float(), (N,), eps=1e-5).to(torch.bfloat16)
            assert torch.equal(total, a + b)
            assert (normed == want).float().mean() > 0.999 and ((normed.float() - want.float()).abs() <= _one_bf16_step(want)).all()
        gu = (torch.randn(B, 2 * N) * 4).to(torch.bfloat16)
        gu[0, :6] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -3e38])  # 0, saturated, tiny, e^-x past float32
        want = torch.nn.functional.silu(gu[:, :N]) * gu[:, N:]
        got = mod.silu_mul(gu, N)
        # e^-x from the kernels' polynomial, not torch's: a rounding apart, rarely
        assert (got == want).float().mean() > 0.999 and ((got.float() - want.float()).abs() <= _one_bf16_step(want)).all()
    with pytest.raises(RuntimeError, match=r"\(B, 2I\)"):
        mod.silu_mul(gu, N + 16)
    with pytest.raises(RuntimeError, match="x and y"):
        mod.add_rms_norm(x, delta[:, :16], w, 1e-5)
    for B, H, KV, D, T in ((1, 9, 3, 64, 0), (4, 8, 2, 32, 11)):
        qkv = torch.randn(B, H + 2 * KV, D).to(torch.bfloat16)
        cos, sin = torch.randn(B, 1, D).to(torch.bfloat16), torch.randn(B, 1, D).to(torch.bfloat16)
        kbuf, vbuf = torch.zeros(B, KV, T + 5, D, dtype=torch.bfloat16), torch.zeros(B, KV, T + 5, D, dtype=torch.bfloat16)
        want_k, want_v = kbuf.clone(), vbuf.clone()
        qk = qkv[:, : H + KV] * cos + qkv[:, : H + KV].roll(D // 2, -1) * sin
        want_k[:, :, T], want_v[:, :, T] = qk[:, H:], qkv[:, H + KV :]
        q = mod.rope_into_cache(qkv, cos, sin, kbuf, vbuf, H, T)
        assert torch.equal(q, qk[:, :H]) and torch.equal(kbuf, want_k) and torch.equal(vbuf, want_v)
    with pytest.raises(RuntimeError, match="T within the buffers"):
        mod.rope_into_cache(qkv, cos, sin, kbuf, vbuf, H, T + 5)


@needs_kernel
def test_the_engine_in_bfloat16_decodes_on_the_kernels(kernels, tiny_model):
    """The tiny model in bfloat16 through the engine: every decode step on the kernels, and the
    logprobs it records are those a full forward of the sampled tokens gives (what the Trainer
    computes) as closely as without them."""
    import asyncio

    from transformers import AutoModelForCausalLM

    from services.explorer.serving.engines.base import GenerateRequest, SamplingParams

    full = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.bfloat16).eval()
    rng = random.Random(4)
    prompts = [ids(rng, n, set()) for n in (5, 12, 30)]

    async def run(kernels):
        e = HFEngine(model_path=str(tiny_model), dtype="bfloat16", device="cpu", max_batch_size=8, decode_kernels=kernels)
        await e.start()
        try:
            async def one(i, p):
                out, lps = [], []
                req = GenerateRequest(request_id=f"r{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=24, seed=i))
                async for ups in e.generate(req):
                    for u in ups:
                        out, lps = out + u.token_ids, lps + u.logprobs
                return p, out, lps
            assert (e._ksample is not None) == (kernels is None)  # its sampler on the kernels too
            return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)]), e.stats().extra
        finally:
            await e.shutdown()

    gaps = {}
    for kernels in (None, False):
        results, stats = asyncio.run(run(kernels))
        assert (stats["fast_decode_kernel_steps"] > 0) == (kernels is None) and stats["fast_decode_steps"] > 0
        diffs = []
        for p, out, lps in results:
            with torch.inference_mode():
                logp = full(torch.tensor([p + out])).logits[0, len(p) - 1 : -1].float().log_softmax(-1)
            diffs += (logp.gather(-1, torch.tensor(out)[:, None])[:, 0] - torch.tensor(lps)).abs().tolist()
        gaps[kernels] = torch.tensor(diffs)
    assert gaps[None].mean() <= 2 * gaps[False].mean() + 0.01 and gaps[None].max() < 0.2, gaps


def test_where_the_kernel_cannot_run_the_products_stay_on_onednn(monkeypatch):
    """A float32 model, a copy over the budget, a CPU without AVX-512 BF16 (or no compiler): the step
    runs oneDNN's products and says why; asked for with decode_kernels true, the reason is the error."""
    model32 = _model("llama", torch.float32)
    dec, _ = FastDecoder.build(model32, CPU, packed=True, fuse_budget=1 << 30)
    assert dec.kernel == "the model is in float32; the kernels are for bfloat16"
    model = _model("llama", torch.bfloat16)
    fuse = FastDecoder.build(model, CPU, packed=True, fuse_budget=1 << 30, kernels=False)[0].extra_bytes
    dec, _ = FastDecoder.build(model, CPU, packed=True, fuse_budget=fuse + 1000)
    assert "does not fit what is left of the packed copies' budget" in dec.kernel and dec.extra_bytes == fuse
    monkeypatch.setattr(decode_kernels, "load", lambda: (None, "this CPU has no AVX-512 BF16"))
    dec, _ = FastDecoder.build(model, CPU, packed=True, fuse_budget=1 << 30)
    assert dec.kernel == "this CPU has no AVX-512 BF16"
    want, _, (new, attn, pos, cache) = _one_step(model)
    torch.testing.assert_close(dec.step(new, attn, pos, cache, [None] * 4)[0], want, rtol=2e-2, atol=2e-2)
    assert dec.kernel_steps == 0
    dec, why = FastDecoder.build(model, CPU, packed=True, fuse_budget=1 << 30, kernels=True)
    assert dec is None and why == "engine.decode_kernels is true, but this CPU has no AVX-512 BF16"


def test_the_engine_refuses_a_kernel_it_cannot_run(tiny_model):
    with pytest.raises(EngineError, match="needs engine.fast_decode"):
        HFEngine(model_path=str(tiny_model), dtype="bfloat16", device="cpu", fast_decode=False, decode_kernels=True)
    e = HFEngine(model_path=str(tiny_model), dtype="float32", device="cpu", decode_kernels=True)
    with pytest.raises(EngineError, match="engine.decode_kernels: .*the kernels are for bfloat16"):
        e._load()
