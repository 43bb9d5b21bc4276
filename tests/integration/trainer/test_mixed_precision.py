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


def _policy(tiny_model, *, mixed: bool) -> Policy:
    torch.manual_seed(0)
    p = Policy(model_path=str(tiny_model), dtype="bfloat16", device="cpu", lora=LoraSection(r=8, alpha=16))
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


def test_autocast_lora_matches_pefts_float32_casting(tiny_model):
    mixed, cast = _policy(tiny_model, mixed=True), _policy(tiny_model, mixed=False)
    assert mixed.mixed and not cast.mixed
    assert {q.dtype for q in mixed.adapter_parameters("agent")} == {torch.float32}
    rng = random.Random(0)
    prefix = [rng.randrange(3, 200) for _ in range(40)]
    prompts = [prefix + [rng.randrange(3, 200) for _ in range(n)] for n in (2, 9, 5)]
    responses = [[rng.randrange(3, 200) for _ in range(n)] for n in (6, 3, 8)]
    batch = pack(prompts, responses, [1.0, 0.8, 1.2], mixed.pad_id, share_prefix_min=16)
    a, ga = _run(mixed, batch)
    b, gb = _run(cast, batch)
    m = batch.response_mask.bool()
    assert a.dtype == torch.float32
    torch.testing.assert_close(a[m], b[m], atol=0.05, rtol=0.02)
    assert ga.keys() == gb.keys() and len(ga) == len(mixed.adapter_parameters("agent"))
    assert all(g.dtype == torch.float32 for g in ga.values())
    flat_a = torch.cat([ga[n].flatten() for n in sorted(ga)])
    flat_b = torch.cat([gb[n].flatten() for n in sorted(gb)])
    cosine = float(torch.nn.functional.cosine_similarity(flat_a, flat_b, dim=0))
    assert cosine > 0.99, cosine
    assert abs(float(flat_a.norm() / flat_b.norm()) - 1) < 0.05


def test_the_engine_samples_in_the_trainers_dtype_and_records_what_it_recomputes(tiny_model, tmp_path):
    """The hf engine in bfloat16 takes an adapter the Trainer wrote in float32 as bfloat16 weights
    (nothing trains there); the logprobs it records are the Trainer's teacher-forced ones (mixed
    precision) to bfloat16's precision, so importance ratios start near 1."""
    import asyncio

    from services.explorer.serving.engines.base import AdapterRef, GenerateRequest, SamplingParams
    from services.explorer.serving.engines.hf import HFEngine

    trainer = _policy(tiny_model, mixed=True)
    trainer.save_adapter("agent", tmp_path)
    rng = random.Random(1)
    prompt = [rng.randrange(3, 200) for _ in range(30)]

    async def sample() -> tuple[list[int], list[float], set]:
        engine = HFEngine(model_path=str(tiny_model), dtype="bfloat16", device="cpu", max_batch_size=4)
        await engine.start()
        try:
            await engine.add_adapter(AdapterRef(agent="agent", version=1, name="agent-v1", int_id=1, path=str(tmp_path)))
            dtypes = {q.dtype for n, q in engine._peft.named_parameters() if ".agent-v1." in n and "lora_" in n}
            req = GenerateRequest(request_id="r", prompt_token_ids=prompt, n=1,
                                  adapter=AdapterRef(agent="agent", version=1, name="agent-v1", int_id=1, path=str(tmp_path)),
                                  params=SamplingParams(temperature=1.0, max_tokens=12, seed=3))
            ids, lps = [], []
            async for updates in engine.generate(req):
                for u in updates:
                    ids += u.token_ids
                    lps += u.logprobs
            return ids, lps, dtypes
        finally:
            await engine.shutdown()

    ids, lps, dtypes = asyncio.run(sample())
    assert dtypes == {torch.bfloat16} and len(ids) >= 2
    with torch.no_grad():
        ref = trainer.forward(pack([prompt], [ids], [1.0], trainer.pad_id), need_hidden=False).logprobs[0]
    torch.testing.assert_close(torch.tensor(lps), ref, atol=0.05, rtol=0.02)
