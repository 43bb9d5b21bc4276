"""A buffer with a known reward signal, sampled for real from the tiny model.

Reward 1 when the response starts with a token of even id, 0 otherwise: a signal the base model
hits about half the time and that depends on the response alone. What the objectives optimize can
be read off a model exactly: the share of probability it gives to the rewarded responses among
the responses it trained on (``rewarded_share``).
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
    from services.explorer.serving.engines.base import GenerateRequest, SamplingParams
    from services.explorer.serving.engines.hf import HFEngine

    engine = HFEngine(model_path=str(model_path), max_batch_size=64, seed=seed)
    await engine.start()

    async def one(i: int, text: str):
        ids = prompt_ids(engine.tokenizer, text)
        choices = {}
        # A seed per request: the samples do not depend on how the engine happened to batch them.
        params = SamplingParams(max_tokens=max_tokens, seed=seed * 100_003 + i)
        req = GenerateRequest(request_id=str(i), prompt_token_ids=ids, params=params, n=n)
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
                seed: int = 0, prompts: list[str] = PROMPTS, model_version: int = 0,
                task_prefix: str | None = None) -> list[Experience]:
    """Sample n responses per prompt (one task_id per prompt, run_id the choice's index), reward them,
    commit them. ``task_prefix``: task ids ``<prefix>-<k>``, so several agents' calls can share episodes."""
    tokenizer, sampled = asyncio.run(_sample(model_path, prompts, n, max_tokens, seed))
    records = []
    for k, (text, ids, choices) in enumerate(sampled):
        completion = new_id("chatcmpl")
        for i, (resp, lps) in enumerate(choices):
            records.append(Experience(
                experience_id=experience_id(completion, i), completion_id=completion, agent=agent,
                model_version=model_version,
                task_id=f"{task_prefix}-{k}" if task_prefix else f"{agent}-task-{seed}-{k}", run_id=str(i), prompt_token_ids=ids,
                response_token_ids=resp, response_logprobs=lps, messages=[{"role": "user", "content": text}],
                response={"role": "assistant", "content": tokenizer.decode(resp, skip_special_tokens=True)},
                sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": max_tokens, "seed": None},
                reward=reward_of(resp), status=ExperienceStatus.COMMITTED,
            ))
    db = buffer.create_buffer_engine(url)
    buffer.insert_experiences(engine=db, records=records)
    db.dispose()
    return records


def response_logprobs(model, prompt: list[int], responses: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """log P(response | prompt) of each response, in one forward over them all (right-padded: a
    causal model's logits at the real positions do not see the padding)."""
    width = max(len(r) for r in responses)
    ids = torch.tensor([list(prompt) + list(r) + [0] * (width - len(r)) for r in responses])
    mask = torch.tensor([[1] * (len(prompt) + len(r)) + [0] * (width - len(r)) for r in responses])
    logits = model(input_ids=ids, attention_mask=mask).logits[:, len(prompt) - 1: -1].float()
    logp = torch.log_softmax(logits, -1)
    return [logp[k, : len(r)].gather(-1, torch.tensor(r).unsqueeze(-1)).sum() for k, r in enumerate(responses)]


def rewarded_share(model, experiences) -> float:
    """How much of its probability the model gives to the rewarded responses among the responses
    sampled for the same prompt: per prompt, sum of P(rewarded) / sum of P(all), averaged over the
    prompts that have both kinds (each distinct response counted once).

    ``experiences``: records with prompt_token_ids, response_token_ids and reward (0 or 1).
    """
    groups: dict[tuple, dict[tuple, float]] = {}
    for e in experiences:
        groups.setdefault(tuple(e.prompt_token_ids), {})[tuple(e.response_token_ids)] = float(e.reward)
    shares = []
    with torch.no_grad():
        for prompt, responses in groups.items():
            if len(set(responses.values())) < 2:
                continue
            logps = dict(zip(responses, response_logprobs(model, list(prompt), list(responses))))
            all_lp = torch.stack(list(logps.values()))
            rewarded = torch.stack([lp for r, lp in logps.items() if responses[r] == 1.0])
            shares.append(torch.exp(torch.logsumexp(rewarded, 0) - torch.logsumexp(all_lp, 0)).item())
    assert shares, "the trained batches must hold prompts with rewarded and unrewarded responses"
    return sum(shares) / len(shares)


# The Trainer fault tests' buffer (tests/integration/trainer/conftest.py faults_db): prompts, sampled
# responses to each, and how many rows lack a reward (the Trainer discards those)
FAULT_PROMPTS, FAULT_RESPONSES, FAULT_UNREWARDED = 30, 2, 4
