"""The chunked logprobs, entropy and gathered logprobs (services/trainer/token_stats.py) against the
plain computation, values and gradients, with temperatures, grammar masks and odd chunk sizes."""

from __future__ import annotations

import pytest
import torch

from services.trainer.token_stats import token_stats
from tests.bench.logits import plain_token_stats as plain


def case(seed: int, *, B=3, R=7, V=11, k=3, masked=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, R, V, generator=g) * 3
    temps = torch.tensor([1.0, 0.7, 1.3])[:B]
    allowed = None
    if masked:
        allowed = torch.rand(B, R, V, generator=g) > 0.4
        allowed[..., 0] = True
    targets = torch.randint(0, V, (B, R), generator=g)
    if allowed is not None:  # the sampled token was allowed, as under a grammar
        targets = torch.where(allowed.gather(-1, targets.unsqueeze(-1)).squeeze(-1), targets, torch.zeros_like(targets))
    gather = torch.randint(0, V, (B, R, k), generator=g)
    if allowed is not None:
        gather = torch.where(allowed.gather(-1, gather), gather, torch.zeros_like(gather))
    weights = [torch.randn(B, R, generator=g), torch.randn(B, R, generator=g), torch.randn(B, R, k, generator=g)]
    return logits, temps, targets, allowed, gather, weights


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
def test_values_and_gradients_match_the_plain_computation(masked, chunk):
    logits, temps, targets, allowed, gather, (w_lp, w_ent, w_g) = case(1, masked=masked)
    a = logits.clone().requires_grad_(True)
    lp, ent, gathered, top = plain(a, temps, targets, allowed, gather, top_k=4)
    ((lp * w_lp).sum() + (ent * w_ent).sum() + (gathered * w_g).sum()).backward()
    b = logits.clone().requires_grad_(True)
    s = token_stats(b, temps, targets, allowed=allowed, gather=gather, top_k=4, entropy_grad=True, chunk=chunk)
    ((s.logprobs * w_lp).sum() + (s.entropy * w_ent).sum() + (s.gathered * w_g).sum()).backward()
    assert torch.allclose(s.logprobs, lp, atol=1e-5) and torch.allclose(s.entropy, ent, atol=1e-5)
    assert torch.allclose(s.gathered, gathered, atol=1e-5)
    assert torch.allclose(s.top[0], top.values, atol=1e-5) and torch.equal(s.top[1], top.indices)
    assert torch.allclose(b.grad, a.grad, atol=1e-5), (b.grad - a.grad).abs().max()


def test_the_entropy_carries_no_gradient_unless_asked_and_logprobs_alone_backpropagate():
    logits, temps, targets, _, _, (w_lp, _, _) = case(2)
    a = logits.clone().requires_grad_(True)
    (plain(a, temps, targets)[0] * w_lp).sum().backward()
    b = logits.clone().requires_grad_(True)
    s = token_stats(b, temps, targets, chunk=2)
    assert not s.entropy.requires_grad and s.gathered is None and s.top is None
    (s.logprobs * w_lp).sum().backward()
    assert torch.allclose(b.grad, a.grad, atol=1e-6)


def test_low_precision_logits_get_a_gradient_of_their_own_dtype():
    logits, temps, targets, _, _, (w_lp, _, _) = case(3)
    b = logits.to(torch.bfloat16).requires_grad_(True)
    s = token_stats(b, temps, targets, chunk=4)
    assert s.logprobs.dtype == torch.float32
    (s.logprobs * w_lp).sum().backward()
    assert b.grad.dtype == torch.bfloat16
    a = logits.to(torch.bfloat16).float().requires_grad_(True)
    (plain(a, temps, targets)[0] * w_lp).sum().backward()
    assert torch.allclose(b.grad.float(), a.grad, atol=2e-2)


def test_gradcheck_in_double_precision():
    logits, temps, targets, allowed, gather, _ = case(4, B=2, R=3, V=5, k=2, masked=True)
    x = logits.double().requires_grad_(True)

    def f(z):
        s = token_stats(z, temps[:2], targets, allowed=allowed, gather=gather, entropy_grad=True, chunk=2)
        return s.logprobs, s.entropy, s.gathered

    # the statistics are computed in float32 from the logits: compare in float32's tolerance
    assert torch.autograd.gradcheck(f, (x,), eps=1e-3, atol=2e-3, rtol=1e-2)


def test_positions_past_the_targets_get_no_gradient_and_a_disallowed_gathered_id_none_either():
    logits, temps, targets, allowed, gather, (w_lp, _, w_g) = case(5, masked=True)
    gather[0, 0, 0] = int((~allowed[0, 0]).nonzero()[0])  # a teacher's id the grammar did not allow here
    extra = torch.randn(3, 1, 11)
    a = logits.clone().requires_grad_(True)
    lp, _, gathered, _ = plain(a, temps, targets, allowed, gather)
    w_g[0, 0, 0] = 0.0  # its logprob is -inf: a weight of 0 keeps the loss finite, as the top-k term's does
    ((lp * w_lp).sum() + (gathered * w_g).sum()).backward()
    b = torch.cat([logits, extra], dim=1).requires_grad_(True)
    s = token_stats(b, temps, targets, allowed=allowed, gather=gather, chunk=3)
    ((s.logprobs * w_lp).sum() + (s.gathered * w_g).sum()).backward()
    finite = torch.isfinite(gathered)
    assert not finite[0, 0, 0] and torch.equal(torch.isfinite(s.gathered), finite)
    assert torch.allclose(s.gathered[finite], gathered[finite], atol=1e-5)
    assert torch.allclose(b.grad[:, :7], a.grad, atol=1e-5) and not b.grad[:, 7:].any()
    with pytest.raises(ValueError, match="do not cover the targets"):
        token_stats(logits[:, :3], temps, targets)
