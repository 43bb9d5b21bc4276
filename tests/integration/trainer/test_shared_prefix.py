"""The Trainer computes a prefix every row of a micro-batch shares once (services/trainer/policy.py):
the logprobs, entropies, hidden states and LoRA gradients must be those of the plain layout."""

from __future__ import annotations

import random

import pytest
import torch

from services.trainer.config import LoraSection
from services.common.models import shared_prefix_len
from services.trainer.policy import Policy, pack

pytestmark = pytest.mark.integration


def test_shared_prefix_len_leaves_every_prompt_a_token_of_its_own():
    assert shared_prefix_len([[1, 2, 3, 4], [1, 2, 3, 5]]) == 3
    assert shared_prefix_len([[1, 2, 3], [1, 2, 3, 4, 5]]) == 2  # the shorter one keeps its last token
    assert shared_prefix_len([[7, 2], [1, 2]]) == 0
    assert shared_prefix_len([[1, 2, 3]]) == 2
    b = pack([[1, 2, 3, 4], [1, 2, 3, 5, 6]], [[9], [8, 7]], [1.0, 1.0], 0, share_prefix_min=2)
    assert b.prefix_ids.tolist() == [1, 2, 3] and b.prompt_len == 2
    assert b.input_ids.tolist() == [[0, 4, 9, 0], [5, 6, 8, 7]]
    assert b.position_ids[1].tolist() == [3, 4, 5, 6] and b.position_ids[0, 1:3].tolist() == [3, 4]
    assert pack([[1, 2, 3, 4], [1, 2, 3, 5]], [[9], [8]], [1.0, 1.0], 0, share_prefix_min=4).prefix_ids is None  # too short


@pytest.fixture(scope="module")
def policy(tiny_model):
    torch.manual_seed(0)
    p = Policy(model_path=str(tiny_model), dtype="float32", device="cpu", lora=LoraSection(r=8, alpha=16))
    p.add_agent("agent", critic=False)
    p.activate("agent")
    with torch.no_grad():  # a non-zero adapter, so its gradients flow through every layer
        for q in p.adapter_parameters("agent"):
            q.add_(torch.randn_like(q) * 0.05)
    return p


def _run(policy: Policy, batch, adapter: bool = True):
    policy.model.zero_grad(set_to_none=True)
    out = policy.forward(batch, need_hidden=True, adapter=adapter)
    mask = batch.response_mask
    if adapter:
        ((out.logprobs * mask).sum() + 0.1 * (out.hidden.sum(-1) * mask).sum()).backward()
    grads = {n: q.grad.clone() for n, q in policy.model.named_parameters() if q.grad is not None}
    return out, grads


def test_logprobs_hidden_states_and_gradients_match_the_plain_layout(policy):
    rng = random.Random(0)
    prefix = [rng.randrange(3, 200) for _ in range(40)]
    prompts = [prefix + [rng.randrange(3, 200) for _ in range(n)] for n in (1, 5, 12, 3)]
    responses = [[rng.randrange(3, 200) for _ in range(n)] for n in (4, 1, 7, 6)]
    temps = [1.0, 0.7, 1.0, 1.3]
    plain = pack(prompts, responses, temps, policy.pad_id)
    shared = pack(prompts, responses, temps, policy.pad_id, share_prefix_min=16)
    assert shared.prefix_len == 40 and plain.prefix_len == 0
    a, ga = _run(policy, plain)
    b, gb = _run(policy, shared)
    m = plain.response_mask.bool()
    torch.testing.assert_close(b.logprobs[m], a.logprobs[m], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(b.entropy[m], a.entropy[m], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(b.hidden[m], a.hidden[m], atol=1e-4, rtol=1e-4)
    assert ga and ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], atol=1e-4, rtol=1e-3, msg=name)
    # the reference pass (adapter off) too
    with torch.no_grad():
        ra, _ = _run(policy, plain, adapter=False)
        rb, _ = _run(policy, shared, adapter=False)
    torch.testing.assert_close(rb.logprobs[m], ra.logprobs[m], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(ra.logprobs[m], a.logprobs[m], atol=1e-3)  # the adapter matters, so the check above means something
