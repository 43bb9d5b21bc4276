"""Advantage estimators over tensors: GAE for PPO, in the learners (GRPO's group-relative ones, which the
driver computes without torch, are in group.py)."""

from __future__ import annotations

import torch

from services.trainer.algorithms.masking import masked_sum


def terminal_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) episode rewards -> (B, T) per-token rewards with the reward on each last real token."""
    lengths = mask.sum(-1).long()  # (B,)
    out = torch.zeros_like(mask, dtype=rewards.dtype)
    rows = torch.arange(mask.shape[0])
    has = lengths > 0
    out[rows[has], lengths[has] - 1] = rewards[has]
    return out


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, eq. 16), per token.

    Args:
        token_rewards: (B, T) reward received after each token (usually only the last is non-zero).
        values: (B, T) V(s_t), the critic's value before token t is generated.
        mask: (B, T) 1 on real response tokens. The value after the last real token is 0 (terminal).

    Returns (advantages, returns), both (B, T) and 0 on padding:
        delta_t = r_t + gamma * V_{t+1} * m_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1} * m_{t+1}
        G_t     = A_t + V_t
    """
    B, T = values.shape
    adv = torch.zeros_like(values)
    next_adv = torch.zeros(B, dtype=values.dtype, device=values.device)
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = a * m
        # Padding after the end must not leak into the last real token: carry zeros through it.
        next_adv = a * m
        next_value = values[:, t] * m
    returns = (adv + values) * mask
    return adv, returns


def sequence_logprob(token_logprobs: torch.Tensor, mask: torch.Tensor, *, mode: str) -> torch.Tensor:
    """(B, T) token logprobs -> (B,) log-probability of the whole response as one action.

    ``sum`` is the true log-probability of the action (MARFT's action-level optimisation);
    ``mean`` is its length-normalised form (GSPO), which keeps the sequence ratio well-scaled.
    """
    total = masked_sum(token_logprobs, mask, dim=-1)
    if mode == "sum":
        return total
    if mode == "mean":
        return total / mask.sum(-1).clamp(min=1)
    raise ValueError(f"unknown sequence logprob mode {mode!r}")


def episode_gae(
    values: list[torch.Tensor], reward: float, *, gamma: float, lam: float
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """GAE through one multi-call episode, the reward at the end of its last call.

    The sampled tokens of the episode's calls, in order, are one trajectory: between two calls the
    environment (tool output, the user) acts, and the value of the next call's first token is what
    the previous call's last token bootstraps from. One call is plain per-token ``gae``.

    Args:
        values: per call, (L_i,) V before each of its sampled tokens.
    Returns (advantages, returns): per call, (L_i,) each.
    """
    flat = torch.cat(values).unsqueeze(0)  # (1, sum L_i)
    rewards = torch.zeros_like(flat)
    rewards[0, -1] = reward
    adv, ret = gae(rewards, flat, torch.ones_like(flat), gamma=gamma, lam=lam)
    sizes = [len(v) for v in values]
    return list(adv[0].split(sizes)), list(ret[0].split(sizes))


def turn_gae(turn_values: torch.Tensor, reward: float, *, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the turns of an episode when each call is one action (sequence level): V_t is the
    value before call t, the reward arrives after the last. (T,) in, ((T,) advantages, (T,) returns) out."""
    rewards = torch.zeros_like(turn_values).unsqueeze(0)
    rewards[0, -1] = reward
    adv, ret = gae(rewards, turn_values.unsqueeze(0), torch.ones_like(rewards), gamma=gamma, lam=lam)
    return adv[0], ret[0]
