"""The hf engine on CUDA (skipped without a GPU: CI has none; run by hand on a GPU machine with
`python -m pytest tests/gpu`, which needs torch, transformers, peft and pydantic).

On the tiny model built here, with requests in flight the whole time: the logprobs the engine records
are those of a teacher-forced forward pass of the same tokens (float32 on the CPU, transformers and
peft), on the base model and on LoRA versions loaded and unloaded while other requests decode (the hot
swap the Explorer does on a new version). ``KAIZEN_GPU_TEST_DEVICE=cpu`` runs it against the CPU itself
(a check of the test, not of a GPU)."""

from __future__ import annotations

import asyncio
import os
import random

import pytest
import torch

DEVICE = os.environ.get("KAIZEN_GPU_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="no CUDA device")]


def _adapter(model, path, seed: int) -> str:
    """A LoRA adapter of random, non-zero weights (the Trainer's target modules)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, target_modules="all-linear")).save_pretrained(path)
    return str(path)


def _teacher_forced(model, adapter: str | None, prompt: list[int], response: list[int]) -> list[float]:
    """Each response token's logprob under the model (with ``adapter``), float32 on the CPU."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    key = (adapter,)
    if key not in _MODELS:
        m = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
        _MODELS[key] = (PeftModel.from_pretrained(m, adapter) if adapter else m).eval()
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = _MODELS[key](input_ids=ids).logits[0, len(prompt) - 1: len(prompt) + len(response) - 1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1).tolist()


_MODELS: dict = {}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logprobs_equal_a_teacher_forced_pass_while_versions_are_swapped_under_load(tiny_model, tmp_path, dtype):
    model = tiny_model
    from services.explorer.serving.engines.base import AdapterRef, GenerateRequest, SamplingParams
    from services.explorer.serving.engines.hf import HFEngine

    v1 = AdapterRef(agent="a", version=1, name="a-v1", int_id=1, path=_adapter(model, tmp_path / "v1", 1))
    v2 = AdapterRef(agent="a", version=2, name="a-v2", int_id=2, path=_adapter(model, tmp_path / "v2", 2))
    engine = HFEngine(model_path=str(model), dtype=dtype, device=DEVICE, max_batch_size=16, seed=0)
    rng = random.Random(3)
    vocab = 0

    def request(rid: str, adapter: AdapterRef | None, max_tokens: int) -> GenerateRequest:
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randrange(6, 40))]
        return GenerateRequest(request_id=rid, prompt_token_ids=prompt, adapter=adapter, n=2,
                               params=SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=rng.randrange(1 << 30)))

    async def collect(req: GenerateRequest) -> dict[int, tuple[list[int], list[float]]]:
        out: dict[int, tuple[list[int], list[float]]] = {}
        async for updates in engine.generate(req):
            for u in updates:
                toks, lps = out.setdefault(u.index, ([], []))
                toks.extend(u.token_ids)
                lps.extend(u.logprobs)
        return out

    async def main():
        nonlocal vocab
        await engine.start()
        try:
            vocab = min(len(engine.tokenizer), 250)
            # long requests on the base model, then v1 loaded while they decode, requests on it, v2 loaded and
            # v1 unloaded while those decode, requests on v2
            running = {f"base{i}": (None, asyncio.create_task(collect(r)), r)
                       for i, r in enumerate(request(f"base{i}", None, 96) for i in range(4))}
            while engine.stats().running == 0:
                await asyncio.sleep(0.01)
            await engine.add_adapter(v1)
            loaded_under_load = [engine.stats().running]
            for i in range(4):
                r = request(f"v1-{i}", v1, 48)
                running[r.request_id] = (v1, asyncio.create_task(collect(r)), r)
            await asyncio.sleep(0.05)
            await engine.add_adapter(v2)
            loaded_under_load.append(engine.stats().running)
            for i in range(4):
                r = request(f"v2-{i}", v2, 48)
                running[r.request_id] = (v2, asyncio.create_task(collect(r)), r)
            await asyncio.gather(*(t for a, t, _ in running.values() if a is v1))
            await engine.remove_adapter(v1)
            loaded_under_load.append(engine.stats().running)
            results = {rid: (a, await t, r) for rid, (a, t, r) in running.items()}
            assert list(engine.adapters) == ["a-v2"], engine.adapters
            return results, loaded_under_load
        finally:
            await engine.shutdown()

    results, under_load = asyncio.run(main())
    assert min(under_load) > 0, under_load  # each version came and went while others decoded
    gaps = []
    for rid, (adapter, choices, req) in results.items():
        assert sorted(choices) == [0, 1], (rid, choices)
        for toks, lps in choices.values():
            assert toks and len(toks) == len(lps), rid
            want = _teacher_forced(model, adapter.path if adapter else None, req.prompt_token_ids, toks)
            gaps.extend(abs(g - w) for g, w in zip(lps, want))
    gaps_t = torch.tensor(gaps)
    if dtype == "float32":
        assert gaps_t.max() < 2e-3, gaps_t.max()
    else:  # bfloat16 weights and activations against float32: close on average, never far
        assert gaps_t.mean() < 0.05 and gaps_t.max() < 0.5, (gaps_t.mean(), gaps_t.max())
