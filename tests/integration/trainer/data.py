"""A buffer with a known reward signal, sampled for real from the tiny model.

Reward 1 when the response starts with a token of even id, 0 otherwise: a signal the base model
hits about half the time, that depends on the response alone, and whose probability can be read
off the model exactly (the total probability of even ids at the first response position).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from services.common import buffer
from services.common.ids import experience_id, new_id
from services.common.records import Experience, ExperienceStatus

PROMPTS = [f"Task {i}: say something about {w}." for i, w in enumerate(["cats", "rain", "paris", "code", "music", "trees"] * 8)]


def reward_of(response_ids: list[int]) -> float:
    return 1.0 if response_ids and response_ids[0] % 2 == 0 else 0.0


def prompt_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(rendered, add_special_tokens=False)


async def _sample(model_path: Path, prompts: list[str], n: int, max_tokens: int, seed: int):
    from services.explorer.engines.base import GenerateRequest, SamplingParams
    from services.explorer.engines.hf import HFEngine

    engine = HFEngine(model_path=str(model_path), max_batch_size=64, seed=seed)
    await engine.start()

    async def one(i: int, text: str):
        ids = prompt_ids(engine.tokenizer, text)
        choices = {}
        req = GenerateRequest(request_id=str(i), prompt_token_ids=ids, params=SamplingParams(max_tokens=max_tokens), n=n)
        async for ups in engine.generate(req):
            for u in ups:
                c = choices.setdefault(u.index, ([], []))
                c[0].extend(u.token_ids)
                c[1].extend(u.logprobs)
        return text, ids, [choices[k] for k in sorted(choices)]

    out = await asyncio.gather(*(one(i, t) for i, t in enumerate(prompts)))
    await engine.shutdown()
    return engine.tokenizer, out


def fill_buffer(url: str, model_path: Path, *, agent: str = "default", n: int = 4, max_tokens: int = 2,
                seed: int = 0, prompts: list[str] = PROMPTS, model_version: int = 0) -> list[Experience]:
    """Sample n responses per prompt (one task_id per prompt), reward them, commit them."""
    tokenizer, sampled = asyncio.run(_sample(model_path, prompts, n, max_tokens, seed))
    records = []
    for k, (text, ids, choices) in enumerate(sampled):
        completion = new_id("chatcmpl")
        for i, (resp, lps) in enumerate(choices):
            records.append(Experience(
                experience_id=experience_id(completion, i), completion_id=completion, agent=agent,
                model_version=model_version, task_id=f"{agent}-task-{seed}-{k}", run_id=str(i), prompt_token_ids=ids,
                response_token_ids=resp, response_logprobs=lps, messages=[{"role": "user", "content": text}],
                response={"role": "assistant", "content": tokenizer.decode(resp, skip_special_tokens=True)},
                sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": max_tokens, "seed": None},
                reward=reward_of(resp), status=ExperienceStatus.COMMITTED,
            ))
    db = buffer.create_buffer_engine(url)
    buffer.insert_experiences(engine=db, records=records)
    db.dispose()
    return records


def even_first_token_probability(model, tokenizer, prompts: list[str] = PROMPTS) -> float:
    """Mean over prompts of P(first response token has an even id), read exactly from the logits."""
    probs = []
    with torch.no_grad():
        for text in prompts:
            logits = model(torch.tensor([prompt_ids(tokenizer, text)])).logits[0, -1].float()
            p = torch.softmax(logits, -1)
            probs.append(p[0::2].sum().item())
    return sum(probs) / len(probs)
