"""GRPO over episodes: batches of whole task_id groups of whole episodes (task_id + run_id), each
episode's reward relative to the other episodes of its task, the clipped ratio."""

from __future__ import annotations

from datetime import datetime

import torch

from services.common.records import CommittedExperience
from services.trainer.algorithms.advantages import batch_relative, episode_relative
from services.trainer.algorithms.grpo import grpo_loss
from services.trainer.batches import Selection, Usable, aware, to_item
from services.trainer.recipes.base import MicroBatch, clip_args, ratio_inputs


class GRPO:
    name = "grpo"
    uses_critic = False
    uses_ratio = True

    def refuses(self, row: CommittedExperience, cfg) -> str | None:
        return None

    def select(self, usable: list[Usable], *, cfg, now: datetime, sel: Selection) -> None:
        """Whole groups of whole episodes, oldest first. A group (task_id) is complete at
        ``group_size`` episodes (or ``min_group_size`` without one); an incomplete one waits
        ``group_wait_s``, then is trained, discarded or trained against the batch mean
        (``small_groups``). ``train_batch_size`` counts calls."""
        a = cfg.algorithm
        groups: dict[str, dict[str, list[Usable]]] = {}
        for row, w in usable:
            episode = row.run_id if row.run_id is not None else f"__call__{row.experience_id}"
            groups.setdefault(row.task_id or f"__single__{row.experience_id}", {}).setdefault(episode, []).append((row, w))
        chosen: list[list[list[Usable]]] = []
        fallback: list[list[Usable]] = []
        count = 0
        for episodes in groups.values():  # insertion order = oldest first
            if count >= cfg.train_batch_size:
                break
            n = len(episodes)
            calls = sum(len(e) for e in episodes.values())
            age = (now - max(aware(r.updated_at) for e in episodes.values() for r, _ in e)).total_seconds()
            full = n >= a.group_size if a.group_size else n >= a.min_group_size
            if not full and age < a.group_wait_s:
                continue  # more runs of this task may still arrive
            if n >= a.min_group_size:
                chosen.append(list(episodes.values()))
                count += calls
            elif a.small_groups == "discard":
                for e in episodes.values():
                    for r, _ in e:
                        sel.discarded[r.experience_id] = f"group of {n} episodes < min_group_size {a.min_group_size}"
            elif a.small_groups == "batch":
                fallback.extend(episodes.values())
                count += calls
                sel.small_groups += 1
        if count < cfg.train_batch_size:
            return
        episodes = [e for group in chosen for e in group]
        gids = [g for g, group in enumerate(chosen) for _ in group]
        # An episode's reward is its last call's (an episode reward sent for all its calls is the same on each).
        last = lambda e: max(e, key=lambda rw: rw[0].seq)[0].reward  # noqa: E731
        adv = episode_relative(torch.tensor([last(e) for e in episodes]), torch.tensor(gids),
                               std_normalize=a.std_normalize).tolist() if episodes else []
        if fallback:
            rewards = torch.tensor([last(e) for e in episodes + fallback])
            adv += batch_relative(rewards, std_normalize=a.std_normalize)[len(episodes):].tolist()
        items = []
        for e, v in zip(episodes + fallback, adv):
            for r, w in sorted(e, key=lambda rw: rw[0].seq):
                it = to_item(r, w / len(e))  # every episode weighs the same, whatever its number of calls
                it.advantage = v
                items.append(it)
        sel.items = items

    def loss(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        inputs, normalizer = ratio_inputs(mb, mb.advantages)
        return grpo_loss(**inputs, normalizer=normalizer, **clip_args(mb.algorithm))
