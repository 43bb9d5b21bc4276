"""GRPO over episodes: batches of whole task_id groups of whole episodes (task_id + run_id), each
episode's reward relative to the other episodes of its task (the team's, when several agents act in
them), the clipped ratio."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import torch
from pydantic import Field

from services.trainer.algorithms.advantages import batch_relative, episode_relative
from services.trainer.algorithms.grpo import grpo_loss
from services.trainer.batches import Selection, TeamEpisodes, Usable, aware, to_item
from services.trainer.recipes.base import BaseRecipe, MicroBatch, RecipeConfig, clip_args, ratio_inputs


class GRPOConfig(RecipeConfig):
    std_normalize: bool = Field(default=True, description="Divide group-centred rewards by the group std.")
    min_group_size: int = Field(default=2, ge=1, description="Smallest group trained as a group.")
    group_size: int | None = Field(
        default=None, ge=1, description="A group this large is complete at once; smaller ones wait group_wait_s."
    )
    group_wait_s: float = Field(default=30.0, ge=0, description="How long an incomplete group waits for more runs.")
    small_groups: Literal["wait", "discard", "batch"] = Field(
        default="batch",
        description="After group_wait_s, groups under min_group_size keep waiting, are discarded, "
        "or are trained against the batch mean.",
    )


class GRPO(BaseRecipe):
    name = "grpo"
    Config = GRPOConfig
    legacy_keys = {k: k for k in ("std_normalize", "min_group_size", "group_size", "group_wait_s", "small_groups")}
    uses_ratio = True
    team_rewards = True
    config: GRPOConfig

    def select(self, usable: list[Usable], *, batch_size: int, now: datetime, sel: Selection, team: TeamEpisodes) -> None:
        """Whole groups of whole episodes, oldest first. A group (task_id) is complete at
        ``group_size`` episodes (or ``min_group_size`` without one); an incomplete one waits
        ``group_wait_s``, then is trained, discarded or trained against the batch mean
        (``small_groups``). ``train_batch_size`` counts calls.

        With ``algorithm.team_credit``, a group is the team's episodes of the task: those of
        ``team`` this agent sat out count too, at their team reward (their last call's), in the
        group's size and statistics; they carry no calls of this agent, so nothing of them is trained."""
        a, team_credit = self.config, self.objective.team_credit
        groups: dict[str, dict[str, list[Usable]]] = {}
        agent = usable[0][0].agent if usable else None
        for row, w in usable:
            episode = row.run_id if row.run_id is not None else f"__call__{row.experience_id}"
            groups.setdefault(row.task_id or f"__single__{row.experience_id}", {}).setdefault(episode, []).append((row, w))
        chosen: list[tuple[list[list[Usable]], list[float]]] = []  # (this agent's episodes, sat-out team rewards)
        fallback: list[list[Usable]] = []
        count = 0
        for task, episodes in groups.items():  # insertion order = oldest first
            if count >= batch_size:
                break
            sat_out = [ep.reward for run, ep in (team.get(task) or {}).items()
                       if team_credit and run not in episodes and agent not in ep.agents]
            n = len(episodes) + len(sat_out)
            calls = sum(len(e) for e in episodes.values())
            age = (now - max(aware(r.updated_at) for e in episodes.values() for r, _ in e)).total_seconds()
            full = n >= a.group_size if a.group_size else n >= a.min_group_size
            if not full and age < a.group_wait_s:
                continue  # more runs of this task may still arrive
            if n >= a.min_group_size:
                chosen.append((list(episodes.values()), sat_out))
                count += calls
                sel.team_episodes += len(sat_out)
            elif a.small_groups == "discard":
                for e in episodes.values():
                    for r, _ in e:
                        sel.discarded[r.experience_id] = f"group of {n} episodes < min_group_size {a.min_group_size}"
            elif a.small_groups == "batch":
                fallback.extend(episodes.values())
                count += calls
                sel.small_groups += 1
        if count < batch_size:
            sel.team_episodes = 0
            return
        # An episode's reward is its last call's (an episode reward sent for all its calls is the same on each).
        last = lambda e: max(e, key=lambda rw: rw[0].seq)[0].reward  # noqa: E731
        episodes = [e for own, _ in chosen for e in own]
        rewards = [r for own, others in chosen for r in [last(e) for e in own] + others]
        gids = [g for g, (own, others) in enumerate(chosen) for _ in range(len(own) + len(others))]
        mine = [k for g, (own, others) in enumerate(chosen) for k in [1] * len(own) + [0] * len(others)]
        adv_all = episode_relative(torch.tensor(rewards), torch.tensor(gids), std_normalize=a.std_normalize).tolist() \
            if rewards else []
        adv = [v for v, m in zip(adv_all, mine) if m]
        if fallback:
            batch_rewards = torch.tensor([last(e) for e in episodes + fallback])
            adv += batch_relative(batch_rewards, std_normalize=a.std_normalize)[len(episodes):].tolist()
        items = []
        for e, v in zip(episodes + fallback, adv):
            for r, w in sorted(e, key=lambda rw: rw[0].seq):
                it = to_item(r, w / len(e))  # every episode weighs the same, whatever its number of calls
                it.advantage = v
                items.append(it)
        sel.items = items

    def loss(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        inputs, normalizer = ratio_inputs(mb, mb.advantages)
        return grpo_loss(**inputs, normalizer=normalizer, **clip_args(mb.objective))
