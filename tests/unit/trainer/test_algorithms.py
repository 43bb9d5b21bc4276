"""Each loss and estimator against a tiny example worked by hand (the arithmetic is in comments)."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.algorithms.advantages import episode_gae, gae, sequence_logprob, terminal_rewards, turn_gae
from services.trainer.algorithms.group import episode_relative, group_relative
from services.trainer.algorithms.grpo import grpo_loss
from services.trainer.algorithms.masking import aggregate, masked_mean
from services.trainer.algorithms.ppo import clipped_value_loss, ppo_loss
from services.trainer.algorithms.sft import sft_loss
from services.trainer.algorithms.surrogate import clipped_surrogate, kl_k3, kl_penalty

approx = lambda x: pytest.approx(x, abs=1e-5)  # noqa: E731


def test_masked_mean_and_aggregate():
    v = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # real entries 1, 2, 3: mean 2
    assert masked_mean(v, m).item() == approx(2.0)
    assert masked_mean(v, m, dim=-1).tolist() == [1.5, 3.0]
    # sum of real entries 6 over a batch-wide normalizer of 4 tokens -> 1.5
    assert aggregate(v, m, 4).item() == approx(1.5)


def test_clipped_surrogate_hand_worked():
    lp = torch.tensor([0.0, 0.0, -1.0])
    old = torch.tensor([-1.0, -1.0, 0.0])
    adv = torch.tensor([1.0, -1.0, 1.0])
    loss, ratio, clipped = clipped_surrogate(lp, old, adv, clip_low=0.2, clip_high=0.2)
    # ratios: e, e, 1/e
    assert ratio.tolist() == approx([math.e, math.e, 1 / math.e])
    # A>0, r=e: min(e*1, 1.2*1) = 1.2 -> loss -1.2 (clipped)
    # A<0, r=e: min(-e, -1.2) = -e -> loss e (not clipped: the pessimistic term is the unclipped one)
    # A>0, r=1/e: min(0.368, 0.8) = 0.368 -> loss -0.368 (not clipped)
    assert loss.tolist() == approx([-1.2, math.e, -1 / math.e])
    assert clipped.tolist() == [1.0, 0.0, 0.0]


def test_kl_k3_is_zero_when_equal_and_positive_otherwise():
    lp = torch.tensor([-1.0, -1.0])
    ref = torch.tensor([-1.0, -2.0])
    # d = ref - lp = 0 -> e^0 - 0 - 1 = 0;  d = -1 -> e^-1 + 1 - 1 = 0.3679
    assert kl_k3(lp, ref).tolist() == approx([0.0, math.exp(-1)])


def test_terminal_rewards_and_gae_hand_worked():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    r = terminal_rewards(torch.tensor([1.0, 2.0]), mask)
    assert r.tolist() == [[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]]
    values = torch.tensor([[0.5, 0.5, 0.5], [1.0, 1.0, 7.0]])  # 7.0 sits on padding: must not matter
    adv, ret = gae(r, values, mask, gamma=1.0, lam=0.5)
    # row 0: deltas: t2 = 1 + 0 - 0.5 = 0.5; t1 = 0 + 0.5 - 0.5 = 0; t0 = 0
    #        A2 = 0.5; A1 = 0 + 0.5*0.5 = 0.25; A0 = 0 + 0.5*0.25 = 0.125
    # row 1: t1 = 2 + 0 - 1 = 1; t0 = 0 + 1 - 1 = 0 -> A1 = 1, A0 = 0.5
    assert adv.tolist() == [approx([0.125, 0.25, 0.5]), approx([0.5, 1.0, 0.0])]
    # returns = A + V on real tokens
    assert ret.tolist() == [approx([0.625, 0.75, 1.0]), approx([1.5, 2.0, 0.0])]


def test_gae_with_lambda_one_is_reward_to_go_minus_value():
    mask = torch.ones(1, 4)
    values = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    adv, ret = gae(terminal_rewards(torch.tensor([1.0]), mask), values, mask, gamma=1.0, lam=1.0)
    assert ret.tolist() == [approx([1.0, 1.0, 1.0, 1.0])]
    assert adv.tolist() == [approx([0.9, 0.8, 0.7, 0.6])]


def test_group_relative_hand_worked():
    rewards = [1.0, 0.0, 1.0, 0.5, 0.5]
    groups = [0, 0, 0, 1, 1]
    # group 0: mean 2/3 -> centered [1/3, -2/3, 1/3]; population std sqrt((1/9+4/9+1/9)/3) = sqrt(2)/3
    #          normalised: [1/3, -2/3, 1/3] / 0.4714 = [0.7071, -1.4142, 0.7071]
    # group 1: equal rewards -> 0
    adv = group_relative(rewards, groups, std_normalize=True)
    assert adv == approx([0.70710, -1.41421, 0.70710, 0.0, 0.0])
    assert group_relative(rewards, groups, std_normalize=False) == approx([1 / 3, -2 / 3, 1 / 3, 0.0, 0.0])
    # a group whose rewards are equal gets exactly 0, though their mean in floats need not equal them
    assert group_relative([0.1, 0.1, 0.1], [0, 0, 0], std_normalize=True) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="3 rewards but 2 group ids"):
        group_relative([1.0, 0.0, 1.0], [0, 0], std_normalize=True)


def test_sequence_logprob_sum_and_mean():
    lp = torch.tensor([[-1.0, -2.0, -9.0]])
    m = torch.tensor([[1.0, 1.0, 0.0]])
    assert sequence_logprob(lp, m, mode="sum").tolist() == [-3.0]
    assert sequence_logprob(lp, m, mode="mean").tolist() == [-1.5]


def test_grpo_loss_token_level_hand_worked():
    # One sequence of two tokens, on-policy (ratio 1), advantage 2 on each token, batch of 2 tokens:
    # surrogate per token = -min(1*2, 1*2) = -2; token mean = (-2 - 2) / 2 = -2
    lp = torch.tensor([[-0.5, -0.7]], requires_grad=True)
    loss, stats = grpo_loss(
        logprobs=lp, old_logprobs=lp.detach(), advantages=torch.full((1, 2), 2.0), mask=torch.ones(1, 2),
        weights=torch.ones(1, 2), normalizer=2, clip_low=0.2, clip_high=0.2,
    )
    assert loss.item() == approx(-2.0) and stats["clip_frac"].item() == 0.0
    loss.backward()
    # d/dlp of -(exp(lp - old) * A) / N at ratio 1 = -A / N = -1 per token
    assert lp.grad.tolist() == [approx([-1.0, -1.0])]


def test_grpo_kl_term_adds_scaled_k3():
    lp = torch.tensor([[-1.0, -1.0]])
    ref = torch.tensor([[-1.0, -2.0]])
    loss, _ = grpo_loss(
        logprobs=lp, old_logprobs=lp, advantages=torch.zeros(1, 2), mask=torch.ones(1, 2), weights=torch.ones(1, 2),
        normalizer=2, clip_low=0.2, clip_high=0.2,
    )
    kl = kl_penalty(lp, ref, torch.ones(1, 2), 2)
    # k3 per token [0, e^-1]; mean over 2 tokens = 0.18394; times 0.1 = 0.018394; surrogate is 0
    assert kl.item() == approx(math.exp(-1) / 2)
    assert (loss + 0.1 * kl).item() == approx(0.1 * math.exp(-1) / 2)  # as the learner adds it, once


def test_ppo_loss_sequence_level_and_staleness_weight():
    # Two sequences as single actions. Seq 0: log ratio ln 2 (ratio 2), A = 1 -> clipped to 1.2 -> -1.2.
    # Seq 1: ratio 1, A = -1 -> +1, but its staleness weight is 0.5 -> 0.5.
    # policy loss = (-1.2 + 0.5) / 2 sequences = -0.35
    lp = torch.tensor([math.log(2.0), 0.0])
    v = torch.tensor([0.5, 0.0])
    loss, stats = ppo_loss(
        logprobs=lp, old_logprobs=torch.zeros(2), advantages=torch.tensor([1.0, -1.0]), values=v,
        old_values=torch.tensor([0.0, 0.0]), returns=torch.tensor([1.0, 0.0]), mask=torch.ones(2),
        weights=torch.tensor([1.0, 0.5]), normalizer=2, clip_low=0.2, clip_high=0.2, value_clip=0.2, vf_coef=0.5,
    )
    assert stats["policy_loss"].item() == approx(-0.35)
    # value: seq 0: V = 0.5, clip to V_old + 0.2 = 0.2; max((0.5-1)^2, (0.2-1)^2) = 0.64 -> 0.5*0.64 = 0.32
    #        seq 1: 0 -> value loss mean = 0.32 / 2 = 0.16; total = -0.35 + 0.5 * 0.16 = -0.27
    assert stats["value_loss"].item() == approx(0.16)
    assert loss.item() == approx(-0.27)
    assert stats["clip_frac"].item() == approx(0.5)


def test_ppo_value_loss_can_cover_states_the_policy_does_not_act_in():
    # Two sequence-level turns; the policy acts in the first only (mask), the critic learns both
    # (value_mask). value 0, return 1 on each: 0.5 * 1^2 per turn, summed over value_mask, / 1.
    kw = dict(logprobs=torch.zeros(2), old_logprobs=torch.zeros(2), advantages=torch.ones(2), values=torch.zeros(2),
              old_values=torch.zeros(2), returns=torch.ones(2), mask=torch.tensor([1.0, 0.0]), weights=torch.ones(2),
              normalizer=1.0, clip_low=0.2, clip_high=0.2, value_clip=10.0, vf_coef=1.0)
    _, own = ppo_loss(**kw)
    _, both = ppo_loss(**kw, value_mask=torch.ones(2))
    assert own["value_loss"] == approx(0.5) and both["value_loss"] == approx(1.0)
    assert own["policy_loss"] == both["policy_loss"] == approx(-1.0)


def test_clipped_value_loss_takes_the_larger_error():
    # V moved from 0 to 1 with returns 0.5: unclipped (1-0.5)^2 = 0.25, clipped V = 0.2: (0.2-0.5)^2 = 0.09
    assert clipped_value_loss(torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([0.5]), clip=0.2).item() == approx(0.125)


def test_sft_loss_is_mean_nll_of_response_tokens():
    lp = torch.log(torch.tensor([[0.5, 0.25, 1.0]]))
    m = torch.tensor([[1.0, 1.0, 0.0]])
    # -(ln 0.5 + ln 0.25) / 2 tokens = (0.6931 + 1.3863) / 2 = 1.0397
    loss, _ = sft_loss(logprobs=lp, mask=m, weights=torch.ones(1, 3), normalizer=2)
    assert loss.item() == approx((math.log(2) + math.log(4)) / 2)


def test_episode_gae_runs_through_the_calls_of_an_episode_hand_worked():
    # Call 0 sampled one token (V 0.5); then a tool answered; call 1 sampled two (V 0.2, 0.1).
    # Reward 1 after the last token; gamma 1, lambda 0.5:
    #   t2: delta = 1 - 0.1 = 0.9                  A = 0.9
    #   t1: delta = 0 + 0.1 - 0.2 = -0.1           A = -0.1 + 0.5 * 0.9 = 0.35
    #   t0: delta = 0 + 0.2 - 0.5 = -0.3 (bootstraps from the next call's first value)
    #                                              A = -0.3 + 0.5 * 0.35 = -0.125
    # returns = A + V = [0.375], [0.55, 1.0]
    adv, ret = episode_gae([torch.tensor([0.5]), torch.tensor([0.2, 0.1])], 1.0, gamma=1.0, lam=0.5)
    assert [a.tolist() for a in adv] == [approx([-0.125]), approx([0.35, 0.9])]
    assert [r.tolist() for r in ret] == [approx([0.375]), approx([0.55, 1.0])]
    # One call is plain per-token GAE with the terminal reward.
    one, _ = episode_gae([torch.tensor([0.2, 0.1])], 1.0, gamma=1.0, lam=0.5)
    ref, _ = gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.2, 0.1]]), torch.ones(1, 2), gamma=1.0, lam=0.5)
    assert one[0].tolist() == approx(ref[0].tolist())


def test_turn_gae_credits_turns_in_order_hand_worked():
    # Values before each call 0.4, 0.7; reward 1 after the last; gamma 0.9, lambda 1:
    #   turn 1: delta = 1 - 0.7 = 0.3                      A = 0.3
    #   turn 0: delta = 0.9 * 0.7 - 0.4 = 0.23             A = 0.23 + 0.9 * 0.3 = 0.5
    # returns = A + V = [0.9, 1.0]
    adv, ret = turn_gae(torch.tensor([0.4, 0.7]), 1.0, gamma=0.9, lam=1.0)
    assert adv.tolist() == approx([0.5, 0.3]) and ret.tolist() == approx([0.9, 1.0])


def test_episode_relative_counts_episodes_not_calls():
    # Task t: episode A (reward 1), episode B (reward 0); task u: one episode (reward 0.5) alone.
    # Centred within each task: A +0.5, B -0.5; u's only episode 0 (no std normalisation).
    adv = episode_relative([1.0, 0.0, 0.5], [0, 0, 1], std_normalize=False)
    assert adv == approx([0.5, -0.5, 0.0])


def test_behaviour_weights_truncate_and_mask_by_hand():
    from services.trainer.algorithms.importance import behaviour_weights

    # proximal - behaviour per token: 0, ln 2, ln 4 -> weights 1, 2, 4; cap 3
    prox = torch.tensor([[0.0, math.log(2.0), math.log(4.0)]])
    behav = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    w, st = behaviour_weights(prox, behav, mask, mode="truncate", cap=3.0, normalizer=3)
    assert w.tolist() == [[approx(1.0), approx(2.0), approx(3.0)]]  # 4 truncated to 3
    assert st["is_weight_mean"].item() == approx(2.0) and st["is_capped_frac"].item() == approx(1 / 3)
    w, st = behaviour_weights(prox, behav, mask, mode="mask", cap=3.0, normalizer=3)
    assert w.tolist() == [[approx(1.0), approx(2.0), 0.0]]  # the token over the cap is left out
    assert st["is_weight_mean"].item() == approx(1.0)
    # padding never counts: the third token masked out of the statistics
    _, st = behaviour_weights(prox, behav, torch.tensor([[1.0, 1.0, 0.0]]), mode="truncate", cap=3.0, normalizer=2)
    assert st["is_weight_mean"].item() == approx(1.5) and st["is_capped_frac"].item() == 0.0
    with pytest.raises(ValueError, match="importance mode"):
        behaviour_weights(prox, behav, mask, mode="clip", cap=3.0, normalizer=3)
