"""The Trainer step's CPU paths (issue 31): an adapted layer's products (services/trainer/lora_products.py),
attention on the grouped layout (services/trainer/attention.py) and the bfloat16 RMSNorm kernel
(services/trainer/train_kernels.py). Each must compute what peft's and transformers' own forwards do,
forward and backward, to the dtype's rounding, and leave every case it does not cover to them."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from services.trainer import attention as grouped_eager
from services.trainer import lora_products, train_kernels
from services.trainer.config import LoraSection
from services.trainer.policy import Policy, pack

pytestmark = pytest.mark.integration


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> None:
    """Equal to ``rel`` of ``b``'s largest magnitude (bfloat16 rounds at 2^-8 of a value)."""
    a, b = a.detach().float(), b.detach().float()
    scale = float(b.abs().max()) or 1.0
    assert float((a - b).abs().max()) <= rel * scale, (float((a - b).abs().max()), scale)


def _peft_linear(dtype: torch.dtype, *, dropout: float = 0.0, adapters: int = 1):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(48, 40, bias=True)).to(dtype)
    model = get_peft_model(net, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["0"]), adapter_name="one")
    for n in range(1, adapters):
        model.add_adapter(f"other{n}", LoraConfig(r=4, lora_alpha=8, target_modules=["0"]))
    with torch.no_grad():
        for name, q in model.named_parameters():
            if "lora_" in name:
                q.copy_(torch.randn_like(q) * 0.2)
    layer = model.base_model.model[0]
    return model, layer


def _forward_backward(layer, x: torch.Tensor, g: torch.Tensor, *, autocast: bool):
    x = x.detach().clone().requires_grad_()
    for q in layer.parameters():
        q.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x)
    y.backward(g.to(y.dtype))
    grads = {n: q.grad.clone() for n, q in layer.named_parameters() if q.grad is not None}
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_adapted_layers_products_are_pefts_forward_and_backward(dtype):
    """float32: peft's sums to float32's rounding; bfloat16 weights with float32 LoRA under autocast (the
    Trainer's mixed precision, peft not casting inputs): to bfloat16's. The adapters' gradients stay float32."""
    model, layer = _peft_linear(dtype)
    autocast = dtype == torch.bfloat16
    if autocast:
        layer.cast_input_dtype_enabled = False  # as Policy does: autocast casts
    x = torch.randn(3, 7, 48).to(dtype)
    g = torch.randn(3, 7, 40)
    ref = _forward_backward(layer, x, g, autocast=autocast)
    assert lora_products.fuse_lora_layers(model) == 1
    assert lora_products._products_apply(layer, x, (), {}) is not None
    out = _forward_backward(layer, x, g, autocast=autocast)
    rel = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(out[:2], ref[:2]):
        assert a.dtype == b.dtype
        _close(a, b, rel)
    assert out[2].keys() == ref[2].keys() == {"lora_A.one.weight", "lora_B.one.weight"}
    for n in ref[2]:
        assert out[2][n].dtype == torch.float32
        _close(out[2][n], ref[2][n], rel)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):  # no graph: the same values
        _close(layer(x), ref[0], rel)


def test_what_the_products_do_not_cover_runs_pefts_own_forward():
    x = torch.randn(2, 5, 48)
    model, layer = _peft_linear(torch.float32, dropout=0.1)
    lora_products.fuse_lora_layers(model)
    assert lora_products._products_apply(layer, x, (), {}) is None  # dropout
    model, layer = _peft_linear(torch.float32, adapters=2)
    lora_products.fuse_lora_layers(model)
    layer.set_adapter(["one", "other1"])
    assert lora_products._products_apply(layer, x, (), {}) is None  # two adapters at once
    layer.set_adapter("one")
    assert lora_products._products_apply(layer, x, (), {}) is not None
    with model.disable_adapter():
        assert lora_products._products_apply(layer, x, (), {}) is None
        base = layer.get_base_layer()
        torch.testing.assert_close(layer(x), base(x), atol=0, rtol=0)
    model, layer = _peft_linear(torch.bfloat16)  # bfloat16 base, float32 LoRA, peft casting inputs (no autocast)
    lora_products.fuse_lora_layers(model)
    assert lora_products._products_apply(layer, x.bfloat16(), (), {}) is None


def _attention_inputs(dtype, *, bool_mask: bool):
    torch.manual_seed(0)
    B, H, KV, T, S, D = 2, 6, 2, 5, 9, 16
    q = torch.randn(B, H, T, D, dtype=dtype, requires_grad=True)
    k = torch.randn(B, KV, S, D, dtype=dtype, requires_grad=True)
    v = torch.randn(B, KV, S, D, dtype=dtype, requires_grad=True)
    keep = torch.ones(B, 1, T, S, dtype=torch.bool).tril(diagonal=S - T)
    keep[1, :, :, :3] = False  # the second row's first keys are padding
    mask = keep if bool_mask else torch.zeros(B, 1, T, S, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)
    return q, k, v, mask


class _Module(nn.Module):
    num_key_value_groups = 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_on_the_grouped_layout_is_transformers_eager(dtype):
    """Queries grouped by their key-value head (no copies of the keys), the scale folded into the queries, the
    mask added in place, the softmax in the queries' dtype: transformers' eager attention's outputs and
    gradients, to the dtype's rounding; a boolean mask as its additive form."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    module = _Module().train()
    rel = 1e-5 if dtype == torch.float32 else 2e-2
    q, k, v, mask = _attention_inputs(dtype, bool_mask=False)
    g = torch.randn(2, 5, 6, 16, dtype=dtype)
    ref, _ = eager_attention_forward(module, q, k, v, mask, scaling=0.25)
    ref.backward(g)
    ref_grads = [t.grad.clone() for t in (q, k, v)]
    for bool_mask in (False, True):
        q, k, v, mask = _attention_inputs(dtype, bool_mask=bool_mask)
        out, weights = grouped_eager.gqa_eager(module, q, k, v, mask, scaling=0.25, position_ids=None)
        assert weights is None and out.shape == ref.shape and out.is_contiguous()
        out.backward(g)
        _close(out, ref, rel)
        for a, b in zip((q.grad, k.grad, v.grad), ref_grads):
            _close(a, b, rel)


def test_an_attention_the_grouped_layout_does_not_cover_runs_the_models_own():
    """A model passing what plain attention has no term for (here soft-capping) gets its own module's eager
    attention, which applies it."""
    from transformers.models.gemma2 import modeling_gemma2

    module = _Module()
    module.__class__ = type("Gemma2Attention", (_Module,), {"__module__": modeling_gemma2.__name__})
    q, k, v, mask = _attention_inputs(torch.float32, bool_mask=False)
    capped, _ = grouped_eager.gqa_eager(module, q, k, v, mask, scaling=0.25, softcap=0.5)
    own, _ = modeling_gemma2.eager_attention_forward(module, q, k, v, mask, scaling=0.25, softcap=0.5)
    torch.testing.assert_close(capped, own, atol=0, rtol=0)
    plain, _ = grouped_eager.gqa_eager(module, q, k, v, mask, scaling=0.25)
    assert not torch.allclose(plain, capped, atol=1e-3)  # the cap changed the scores: it was applied


def _kernel_or_skip():
    mod, why = train_kernels.load()
    if mod is None:
        pytest.skip(f"the Trainer's RMSNorm kernel does not run here: {why}")
    return mod


def test_the_rms_norm_kernel_is_llamas_rms_norm_forward_and_backward():
    """Outputs bit for bit but for a rare rounding (the mean's sum order), gradients to bfloat16's rounding;
    a norm whose weight trains, or in float32, runs transformers' own forward."""
    _kernel_or_skip()
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(96, eps=1e-5).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    norm.weight.requires_grad_(False)
    x = (torch.randn(4, 33, 96) * 3).bfloat16()
    g = torch.randn(4, 33, 96).bfloat16()

    def run(module):
        xx = x.clone().requires_grad_()
        y = module(xx)
        y.backward(g)
        return y.detach(), xx.grad

    ref = run(norm)
    fused = LlamaRMSNorm(96, eps=1e-5).bfloat16()
    fused.load_state_dict(norm.state_dict())
    fused.weight.requires_grad_(False)
    wrapper = nn.Sequential(fused)
    assert train_kernels.fuse_norms(wrapper) == (1, "")
    assert type(fused).forward is train_kernels.norm_forward
    y, gx = run(fused)
    assert float((y != ref[0]).float().mean()) <= 1e-3
    _close(y, ref[0], 1e-2)
    _close(gx, ref[1], 1e-2)
    assert train_kernels.fuse_norms(wrapper) == (1, "")  # idempotent
    fused.weight.requires_grad_(True)  # a weight that trains: transformers' forward (its gradient too)
    xx = x.clone().requires_grad_()
    fused(xx).backward(g)
    assert fused.weight.grad is not None
    f32 = fused.float()
    torch.testing.assert_close(f32(x.float()), LlamaRMSNorm.forward(f32, x.float()), atol=0, rtol=0)


def test_a_mixed_precision_step_on_the_cpu_paths_is_the_step_on_pefts_and_transformers_own(tiny_model, monkeypatch):
    """A Policy in bfloat16 on the CPU takes all three paths by default; its logprobs, entropy and LoRA
    gradients (a shared prefix computed once included) are those of the same Policy without them."""
    from services.trainer import policy as policy_mod

    def make(fast: bool) -> Policy:
        with monkeypatch.context() as m:
            if not fast:
                m.setattr(policy_mod, "fuse_lora_layers", lambda model: 0)
                m.setattr(train_kernels, "fuse_norms", lambda model: (0, "off"))
                m.setattr(grouped_eager, "register", lambda: "eager")
                m.setattr(grouped_eager, "NAME", "eager")
                m.setattr(train_kernels, "loaded", lambda: None)
            torch.manual_seed(0)
            p = Policy(model_path=str(tiny_model), dtype="bfloat16", device="cpu", lora=LoraSection(r=8, alpha=16))
            p.add_agent("agent", critic=False)
            torch.manual_seed(1)
            with torch.no_grad():
                for q in p.adapter_parameters("agent"):
                    q.add_(torch.randn_like(q) * 0.05)
            return p

    def run(p: Policy, batch):
        p.model.zero_grad(set_to_none=True)
        out = p.forward(batch, need_hidden=False, entropy_grad=True)
        mask = batch.response_mask
        ((out.logprobs * mask).sum() + 0.1 * (out.entropy * mask).sum()).backward()
        return out.logprobs.detach(), {n: q.grad.clone() for n, q in p.model.named_parameters() if q.grad is not None}

    fast = make(True)
    lora_layers = [m for m in fast.model.modules() if type(m) in lora_products._FUSED.values()]
    assert len(lora_layers) == 7 * fast.base.config.num_hidden_layers
    assert fast.base.config._attn_implementation == grouped_eager.NAME
    kernel = train_kernels.load()[0] is not None
    assert fast.fused_norms == (2 * fast.base.config.num_hidden_layers + 1 if kernel else 0)
    assert (train_kernels.loaded() is not None) == kernel  # the token statistics take the kernel too
    rng = random.Random(0)
    prefix = [rng.randrange(3, 200) for _ in range(40)]
    prompts = [prefix + [rng.randrange(3, 200) for _ in range(n)] for n in (2, 9, 5)]
    responses = [[rng.randrange(3, 200) for _ in range(n)] for n in (6, 3, 8)]
    batch = pack(prompts, responses, [1.0, 0.8, 1.2], fast.pad_id, share_prefix_min=16)
    assert batch.prefix_len
    a, ga = run(fast, batch)
    with monkeypatch.context() as m:  # the plain Policy's forwards: transformers' eager, torch's token statistics
        m.setattr(grouped_eager, "NAME", "eager")
        m.setattr(train_kernels, "loaded", lambda: None)
        plain = make(False)
        assert plain.base.config._attn_implementation == "eager" and plain.fused_norms == 0
        assert not any(type(x) in lora_products._FUSED.values() for x in plain.model.modules())
        b, gb = run(plain, batch)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(a[mask], b[mask], atol=0.05, rtol=0.02)
    assert ga.keys() == gb.keys() and len(ga) == len(fast.adapter_parameters("agent"))
    flat_a = torch.cat([ga[n].flatten() for n in sorted(ga)])
    flat_b = torch.cat([gb[n].flatten() for n in sorted(gb)])
    assert float(torch.nn.functional.cosine_similarity(flat_a, flat_b, dim=0)) > 0.99
    assert abs(float(flat_a.norm() / flat_b.norm()) - 1) < 0.05


@pytest.mark.parametrize("temperatures", [(1.0, 1.0), (0.7, 1.3)])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_the_token_statistics_kernel_is_the_chunked_torch_path(temperatures, entropy_grad, monkeypatch):
    """bfloat16 logits with more positions than targets (the rest get a zero gradient), two temperatures:
    the logprobs and entropy to float32's rounding, the gradient to the logits to bfloat16's; logits with a
    grammar's masks, gathered ids or in float32 stay on torch."""
    from services.trainer import token_stats as ts

    mod = _kernel_or_skip()
    torch.manual_seed(0)
    logits = (torch.randn(2, 6, 3000) * 4).bfloat16()
    targets = torch.randint(0, 3000, (2, 5))
    temps = torch.tensor(temperatures)
    w_lp, w_ent = torch.randn(2, 5), torch.randn(2, 5)
    runs = []
    for kernel in (mod, None):
        monkeypatch.setattr(train_kernels, "loaded", lambda k=kernel: k)
        x = logits.clone().requires_grad_()
        calls = []
        real = ts._KernelStats.apply
        monkeypatch.setattr(ts._KernelStats, "apply", lambda *a: calls.append(1) or real(*a))
        s = ts.token_stats(x, temps, targets, entropy_grad=entropy_grad)
        ((s.logprobs * w_lp).sum() + (s.entropy * w_ent).sum()).backward()
        assert bool(calls) == (kernel is not None) and s.entropy.requires_grad == entropy_grad
        runs.append((s.logprobs.detach(), s.entropy.detach(), x.grad))
    (lp, ent, grad), (lp0, ent0, grad0) = runs
    torch.testing.assert_close(lp, lp0, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ent, ent0, atol=1e-4, rtol=1e-5)
    assert grad.dtype == torch.bfloat16 and not grad[:, 5:].any()
    _close(grad, grad0, 1e-2)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        mod.token_stats_forward(logits, 1.0 / temps, torch.full((2, 5), 3000))
    monkeypatch.setattr(train_kernels, "loaded", lambda: mod)
    calls = []
    monkeypatch.setattr(ts._KernelStats, "apply", lambda *a: calls.append(1))
    ts.token_stats(logits.float(), temps, targets)
    ts.token_stats(logits, temps, targets, gather=torch.zeros(2, 5, 2, dtype=torch.long))
    ts.token_stats(logits, temps, targets, allowed=torch.ones(2, 5, 3000, dtype=torch.bool))
    ts.token_stats(logits, temps, targets, top_k=3)
    assert not calls
