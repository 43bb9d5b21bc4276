"""bfloat16 weights with float32 LoRA (services/trainer/policy.py ``Policy.mixed``): the adapters'
products run in bfloat16 under autocast instead of peft casting every activation to float32 and
back. The logprobs and the LoRA gradients must be those of peft's own casting, to bfloat16's
precision, and the adapters stay float32 (the optimizer updates float32 weights)."""

from __future__ import annotations

import random

import pytest
import torch

from services.trainer.config import LoraSection
from services.trainer.policy import Policy, pack

pytestmark = pytest.mark.integration


def _policy(tiny_model, *, mixed: bool, attention: str = "auto") -> Policy:
    torch.manual_seed(0)
    p = Policy(model_path=str(tiny_model), dtype="bfloat16", device="cpu", lora=LoraSection(r=8, alpha=16), attention=attention)
    p.add_agent("agent", critic=False)
    if not mixed:  # peft's own way: every adapted layer casts its input to float32, its sum back
        from peft.tuners.tuners_utils import BaseTunerLayer

        p.mixed = False
        for module in p.model.modules():
            if isinstance(module, BaseTunerLayer):
                module.cast_input_dtype_enabled = True
    torch.manual_seed(1)
    with torch.no_grad():  # the same non-zero adapter in both, so gradients flow through every layer
        for q in p.adapter_parameters("agent"):
            q.add_(torch.randn_like(q) * 0.05)
    return p


def _run(p: Policy, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    p.model.zero_grad(set_to_none=True)
    out = p.forward(batch, need_hidden=False, entropy_grad=True)
    mask = batch.response_mask
    ((out.logprobs * mask).sum() + 0.1 * (out.entropy * mask).sum()).backward()
    return out.logprobs.detach(), {n: q.grad.clone() for n, q in p.model.named_parameters() if q.grad is not None}


def _batch(pad_id: int):
    """Three rows whose prompts share a 40-token prefix (computed once) and differ after it."""
    rng = random.Random(0)
    prefix = [rng.randrange(3, 200) for _ in range(40)]
    prompts = [prefix + [rng.randrange(3, 200) for _ in range(n)] for n in (2, 9, 5)]
    responses = [[rng.randrange(3, 200) for _ in range(n)] for n in (6, 3, 8)]
    return pack(prompts, responses, [1.0, 0.8, 1.2], pad_id, share_prefix_min=16)


def _same_step(a: torch.Tensor, ga: dict, b: torch.Tensor, gb: dict, mask: torch.Tensor, n_params: int) -> None:
    """The same logprobs and LoRA gradients, to bfloat16's precision."""
    m = mask.bool()
    assert a.dtype == torch.float32
    torch.testing.assert_close(a[m], b[m], atol=0.05, rtol=0.02)
    assert ga.keys() == gb.keys() and len(ga) == n_params
    assert all(g.dtype == torch.float32 for g in ga.values())
    flat_a = torch.cat([ga[n].flatten() for n in sorted(ga)])
    flat_b = torch.cat([gb[n].flatten() for n in sorted(gb)])
    cosine = float(torch.nn.functional.cosine_similarity(flat_a, flat_b, dim=0))
    assert cosine > 0.99, cosine
    assert abs(float(flat_a.norm() / flat_b.norm()) - 1) < 0.05


def test_autocast_lora_matches_pefts_float32_casting(tiny_model):
    mixed, cast = _policy(tiny_model, mixed=True), _policy(tiny_model, mixed=False)
    assert mixed.mixed and not cast.mixed
    from peft.tuners.tuners_utils import BaseTunerLayer

    tuners = [m for m in mixed.model.modules() if isinstance(m, BaseTunerLayer)]
    assert tuners and not any(m.cast_input_dtype_enabled for m in tuners)  # autocast, not peft, casts
    assert {q.dtype for q in mixed.adapter_parameters("agent")} == {torch.float32}
    batch = _batch(mixed.pad_id)
    _same_step(*_run(mixed, batch), *_run(cast, batch), batch.response_mask, len(mixed.adapter_parameters("agent")))


def test_in_bfloat16_on_the_cpu_the_trainer_attends_by_plain_products_as_sdpa_does(tiny_model, monkeypatch):
    """trainer.attention auto: eager (plain products, softmax in float32) for bfloat16 weights on a CPU,
    where torch's fused CPU kernel made the demo's step slower; the logprobs and the LoRA gradients
    are SDPA's to bfloat16's precision, a prefix computed once included. A forward whose attention
    scores pass EAGER_MAX_SCORES runs on SDPA; float32 keeps SDPA; a setting that names one gets it."""
    from services.trainer import attention as grouped_eager
    from services.trainer import policy

    eager, sdpa = _policy(tiny_model, mixed=True), _policy(tiny_model, mixed=True, attention="sdpa")
    # eager's arithmetic on the grouped layout (services/trainer/attention.py), under a name of its own
    assert eager.attention == "eager" and eager.base.config._attn_implementation == grouped_eager.NAME
    assert sdpa.attention == sdpa.base.config._attn_implementation == "sdpa"
    batch = _batch(eager.pad_id)
    assert batch.prefix_len
    n = len(eager.adapter_parameters("agent"))
    on_sdpa = _run(sdpa, batch)
    _same_step(*_run(eager, batch), *on_sdpa, batch.response_mask, n)
    assert eager.base.config._attn_implementation == grouped_eager.NAME  # the batch's scores fit
    monkeypatch.setattr(policy, "EAGER_MAX_SCORES", 1)
    large = _run(eager, batch)
    assert eager.base.config._attn_implementation == "sdpa"
    torch.testing.assert_close(large[0], on_sdpa[0], atol=0.0, rtol=0.0)  # the same kernel on the same weights
    full = Policy(model_path=str(tiny_model), dtype="float32", device="cpu", lora=LoraSection(r=8, alpha=16))
    assert full.attention == "sdpa"
    named = Policy(model_path=str(tiny_model), dtype="float32", device="cpu", lora=LoraSection(r=8, alpha=16),
                   attention="eager")
    assert named.attention == "eager" and named.base.config._attn_implementation == grouped_eager.NAME


def test_the_engine_samples_in_the_trainers_dtype_and_records_what_it_recomputes(tiny_model, tmp_path):
    """The hf engine in bfloat16 takes an adapter the Trainer wrote in float32 as bfloat16 weights
    (nothing trains there); the logprobs it records are the Trainer's teacher-forced ones (mixed
    precision) to bfloat16's precision, so importance ratios start near 1: also for the next call of
    the conversation, served on top of the adapter's cached keys and values, which go with it."""
    import asyncio

    from services.explorer.serving.engines.base import AdapterRef, GenerateRequest, SamplingParams
    from services.explorer.serving.engines.hf import HFEngine

    trainer = _policy(tiny_model, mixed=True)
    trainer.save_adapter("agent", tmp_path)
    adapter = AdapterRef(agent="agent", version=1, name="agent-v1", int_id=1, path=str(tmp_path))
    rng = random.Random(1)
    prompt = [rng.randrange(3, 200) for _ in range(30)]

    async def one(engine: HFEngine, rid: str, ids: list[int], seed: int) -> tuple[list[int], list[float]]:
        req = GenerateRequest(request_id=rid, prompt_token_ids=ids, n=1, adapter=adapter,
                              params=SamplingParams(temperature=1.0, max_tokens=12, seed=seed))
        out, lps = [], []
        async for updates in engine.generate(req):
            for u in updates:
                out += u.token_ids
                lps += u.logprobs
        return out, lps

    async def held(engine: HFEngine, ids: list[int]) -> bool:
        """Whether the cache holds ``ids`` once the engine's thread has kept the finished call (it does so
        just after sending the call's last tokens; a next call, queued behind that, always finds it)."""
        for _ in range(500):
            if engine._prefix.peek("agent-v1", ids) > 0:
                return True
            await asyncio.sleep(0.01)
        return False

    async def sample():
        # the cache keeps runs of 8 tokens or more
        engine = HFEngine(model_path=str(tiny_model), dtype="bfloat16", device="cpu", max_batch_size=4, shared_prefix_min_tokens=8)
        await engine.start()
        try:
            await engine.add_adapter(adapter)
            dtypes = {q.dtype for n, q in engine._peft.named_parameters() if ".agent-v1." in n and "lora_" in n}
            first = await one(engine, "r1", prompt, seed=3)
            more = prompt + first[0] + [rng.randrange(3, 200) for _ in range(5)]
            hits = engine._prefix.hits
            second = await one(engine, "r2", more, seed=4)
            assert engine._prefix.hits == hits + 1 and await held(engine, more)
            await engine.clear_prefix_cache()  # on the engine's thread, which alone touches the cache
            assert len(engine._prefix) == 0 and engine._prefix.bytes == 0
            await one(engine, "r3", more, seed=5)
            assert await held(engine, more)
            await engine.remove_adapter(adapter)
            assert engine._prefix.peek("agent-v1", more) == 0  # its entries went with it
            return dtypes, [(prompt, *first), (more, *second)]
        finally:
            await engine.shutdown()

    dtypes, calls = asyncio.run(sample())
    assert dtypes == {torch.bfloat16}
    for ids, out, lps in calls:
        assert out
        with torch.no_grad():
            ref = trainer.forward(pack([ids], [out], [1.0], trainer.pad_id), need_hidden=False).logprobs[0]
        torch.testing.assert_close(torch.tensor(lps), ref, atol=0.05, rtol=0.02)
