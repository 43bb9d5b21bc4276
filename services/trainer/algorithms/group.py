"""Group-relative advantages (GRPO) over plain floats: each reward against its group's. The Trainer's
driver computes them when it selects a batch, and it loads no torch (its start is about 2 s shorter)."""

from __future__ import annotations

import math
from typing import Sequence


def group_relative(rewards: Sequence[float], group_ids: Sequence[int], *, std_normalize: bool, eps: float = 1e-6) -> list[float]:
    """GRPO advantages (Shao et al. 2024, DeepSeekMath, sec. 4.1.2): each reward relative to its group.

    Args:
        rewards: one reward per sequence.
        group_ids: the integer group of each sequence (same task_id = same group).
    Returns one advantage per sequence: (r - mean_g) / (std_g + eps) with std normalisation, else
    r - mean_g. The std is the population std of the group; a group whose rewards are all equal gets 0.
    """
    if len(rewards) != len(group_ids):
        raise ValueError(f"{len(rewards)} rewards but {len(group_ids)} group ids")
    members: dict[int, list[float]] = {}
    for r, g in zip(rewards, group_ids):
        members.setdefault(g, []).append(float(r))
    stats: dict[int, tuple[float, float]] = {}
    for g, rs in members.items():
        if max(rs) == min(rs):
            stats[g] = (rs[0], math.inf)  # no signal: 0 exactly (a mean of equal floats may not equal them)
            continue
        mean = math.fsum(rs) / len(rs)
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in rs) / len(rs))
        stats[g] = (mean, std + eps if std_normalize else 1.0)
    return [(float(r) - stats[g][0]) / stats[g][1] for r, g in zip(rewards, group_ids)]


def batch_relative(rewards: Sequence[float], *, std_normalize: bool, eps: float = 1e-6) -> list[float]:
    """Fallback for sequences without a usable group: relative to the whole batch."""
    return group_relative(rewards, [0] * len(rewards), std_normalize=std_normalize, eps=eps)


def episode_relative(episode_rewards: Sequence[float], episode_groups: Sequence[int], *, std_normalize: bool) -> list[float]:
    """GRPO over episodes: each episode's reward against the other episodes of its group (task).
    A group's statistics count episodes, never calls, so an episode of five calls weighs as much as
    one of one call. One advantage per episode; the caller gives every call of an episode its own."""
    return group_relative(episode_rewards, episode_groups, std_normalize=std_normalize)
