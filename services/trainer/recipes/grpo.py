"""GRPO: batches of whole task_id groups, advantages relative to the group, the clipped ratio."""

from __future__ import annotations

from datetime import datetime

import torch

from services.common.records import CommittedExperience
from services.trainer.algorithms.advantages import batch_relative, group_relative
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
        """Whole groups, oldest first. A group is complete at ``group_size`` runs (or
        ``min_group_size`` without one); an incomplete one waits ``group_wait_s``, then is trained,
        discarded or trained against the batch mean (``small_groups``)."""
        a = cfg.algorithm
        groups: dict[str, list[Usable]] = {}
        for row, w in usable:
            groups.setdefault(row.task_id or f"__single__{row.experience_id}", []).append((row, w))
        chosen: list[list[Usable]] = []
        fallback: list[Usable] = []
        count = 0
        for members in groups.values():  # insertion order = oldest first
            if count >= cfg.train_batch_size:
                break
            n = len(members)
            age = (now - max(aware(r.updated_at) for r, _ in members)).total_seconds()
            full = n >= a.group_size if a.group_size else n >= a.min_group_size
            if not full and age < a.group_wait_s:
                continue  # more runs of this task may still arrive
            if n >= a.min_group_size:
                chosen.append(members)
                count += n
            elif a.small_groups == "discard":
                for r, _ in members:
                    sel.discarded[r.experience_id] = f"group of {n} < min_group_size {a.min_group_size}"
            elif a.small_groups == "batch":
                fallback.extend(members)
                count += n
                sel.small_groups += 1
        if count < cfg.train_batch_size:
            return
        items, gids = [], []
        for g, members in enumerate(chosen):
            for r, w in members:
                items.append(to_item(r, w))
                gids.append(g)
        if items:
            adv = group_relative(torch.tensor([i.reward for i in items]), torch.tensor(gids), std_normalize=a.std_normalize)
            for it, v in zip(items, adv.tolist()):
                it.advantage = v
        if fallback:
            extra = [to_item(r, w) for r, w in fallback]
            rewards = torch.tensor([i.reward for i in items + extra])
            adv = batch_relative(rewards, std_normalize=a.std_normalize)[len(items):]
            for it, v in zip(extra, adv.tolist()):
                it.advantage = v
            items += extra
        sel.items = items

    def loss(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        inputs, normalizer = ratio_inputs(mb, mb.advantages)
        return grpo_loss(**inputs, normalizer=normalizer, **clip_args(mb.algorithm))
