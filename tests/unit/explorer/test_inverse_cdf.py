"""The hf engine's two-level inverse-CDF sampling (engines/hf._inverse_cdf) against the plain one."""

from __future__ import annotations

import torch

from services.explorer.serving.engines.hf import _CDF_BLOCK, _inverse_cdf


def _plain(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = probs.double().cumsum(-1)
    target = (u.double() * cdf[:, -1]).clamp(min=1e-12).unsqueeze(-1)
    return torch.searchsorted(cdf, target).squeeze(-1).clamp(max=probs.shape[1] - 1)


def test_it_draws_the_token_the_whole_cumulative_sum_draws():
    g = torch.Generator().manual_seed(0)
    for vocab in (7, _CDF_BLOCK, 3 * _CDF_BLOCK + 5, 49_152):  # within one block, exactly blocks, padded, SmolLM2's
        probs = torch.softmax(torch.randn(64, vocab, generator=g) * 3, -1)
        u = torch.rand(64, generator=g)
        got, want = _inverse_cdf(probs, u), _plain(probs, u)
        # float32 sums in another order: a draw within rounding of a token's edge may take its neighbour
        assert (got == want).float().mean() >= 0.98 and ((got - want).abs() <= 1).all(), (vocab, got, want)


def test_the_edges_of_the_distribution_and_tokens_of_no_probability():
    vocab = 3 * _CDF_BLOCK
    probs = torch.zeros(4, vocab)
    probs[:, 5] = 0.25  # block 0
    probs[:, _CDF_BLOCK + 17] = 0.5  # block 1
    probs[:, vocab - 1] = 0.25  # the last token
    u = torch.tensor([0.0, 0.2499, 0.5, 0.99999994])
    assert _inverse_cdf(probs, u).tolist() == [5, 5, _CDF_BLOCK + 17, vocab - 1]
    # a whole block of zeros and a u that lands exactly on a block's total: never a token of no probability
    probs = torch.zeros(2, vocab)
    probs[:, 3] = 1.0
    probs[:, 2 * _CDF_BLOCK + 1] = 1.0
    assert _inverse_cdf(probs, torch.tensor([0.5, 0.5000001])).tolist() == [3, 2 * _CDF_BLOCK + 1]


def test_draws_follow_the_distribution():
    g = torch.Generator().manual_seed(1)
    probs = torch.tensor([[0.1] * 3 + [0.0] * (2 * _CDF_BLOCK) + [0.7]]).expand(20_000, -1).contiguous()
    drawn = _inverse_cdf(probs, torch.rand(20_000, generator=g))
    counts = torch.bincount(drawn, minlength=probs.shape[1]).float() / 20_000
    assert counts[3:-1].sum() == 0
    assert torch.allclose(counts[[0, 1, 2, -1]], torch.tensor([0.1, 0.1, 0.1, 0.7]), atol=0.015)
