"""From committed buffer rows to one training batch: staleness, demonstration and group selection.

Pure logic over the rows ``buffer.fetch_committed`` returns, so every rule is unit-tested without a
database. The Trainer calls ``select_batch`` per agent; rows it neither trains on nor discards stay
committed for a later step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import torch

from services.trainer.algorithms.advantages import batch_relative, group_relative
from services.trainer.config import TrainerConfig

log = logging.getLogger(__name__)


@dataclass
class TrainItem:
    """One experience as the learner needs it."""

    experience_id: str
    task_id: str | None
    model_version: int
    prompt_ids: list[int]
    response_ids: list[int]
    old_logprobs: list[float]
    reward: float
    temperature: float
    weight: float = 1.0
    advantage: float | None = None  # GRPO: group-relative, set here; PPO: computed by the learner


@dataclass
class Selection:
    items: list[TrainItem] = field(default_factory=list)
    discarded: dict[str, str] = field(default_factory=dict)  # experience id -> why
    stale_downweighted: int = 0
    small_groups: int = 0

    @property
    def ready(self) -> bool:
        return bool(self.items)


def _aware(t: datetime | None) -> datetime:
    if t is None:
        return datetime.now(timezone.utc)
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def _item(row: dict[str, Any], weight: float) -> TrainItem:
    temperature = float((row.get("sampling") or {}).get("temperature") or 0.0)
    return TrainItem(
        experience_id=row["experience_id"],
        task_id=row.get("task_id"),
        model_version=int(row["model_version"]),
        prompt_ids=list(row["prompt_token_ids"]),
        response_ids=list(row["response_token_ids"]),
        old_logprobs=[float(x) for x in row["response_logprobs"]],
        reward=float(row["reward"]),
        temperature=temperature if temperature > 0 else 1.0,  # greedy samples were scored at T=1
        weight=weight,
    )


def _is_demonstration(row: dict[str, Any], cfg: TrainerConfig) -> bool:
    a = cfg.algorithm
    labels = ((row.get("feedback") or {}).get("labels")) or []
    if a.sft_label and a.sft_label in labels:
        return True
    return a.sft_min_reward is not None and row["reward"] is not None and row["reward"] >= a.sft_min_reward


def select_batch(rows: list[dict[str, Any]], *, cfg: TrainerConfig, current_version: int, now: datetime | None = None) -> Selection:
    """Pick the next batch of ``rows`` (oldest first) for one agent at ``current_version``."""
    now = _aware(now)
    sel = Selection()
    st = cfg.staleness
    usable: list[tuple[dict, float]] = []
    for row in rows:
        lag = current_version - int(row["model_version"])
        if row.get("reward") is None:
            sel.discarded[row["experience_id"]] = "no reward"
            continue
        if not row["response_token_ids"] or len(row["response_token_ids"]) != len(row["response_logprobs"]):
            sel.discarded[row["experience_id"]] = "empty response or logprobs of another length"
            continue
        weight = 1.0
        if lag > st.max_staleness:
            if st.policy == "discard":
                sel.discarded[row["experience_id"]] = f"stale: made by v{row['model_version']}, {lag} versions behind"
                continue
            weight = st.downweight ** (lag - st.max_staleness)
            sel.stale_downweighted += 1
        if cfg.algorithm.name == "sft" and not _is_demonstration(row, cfg):
            sel.discarded[row["experience_id"]] = "not a demonstration (reward below sft_min_reward, no sft_label)"
            continue
        usable.append((row, weight))

    size = cfg.train_batch_size
    if cfg.algorithm.name != "grpo":
        if len(usable) >= size:
            sel.items = [_item(r, w) for r, w in usable[:size]]
        return sel
    _select_groups(usable, cfg, now, sel)
    return sel


def _select_groups(usable: list[tuple[dict, float]], cfg: TrainerConfig, now: datetime, sel: Selection) -> None:
    a = cfg.algorithm
    groups: dict[str, list[tuple[dict, float]]] = {}
    for row, w in usable:
        key = row.get("task_id") or f"__single__{row['experience_id']}"
        groups.setdefault(key, []).append((row, w))
    chosen: list[list[tuple[dict, float]]] = []
    fallback: list[tuple[dict, float]] = []
    count = 0
    for members in groups.values():  # insertion order = oldest first
        if count >= cfg.train_batch_size:
            break
        n = len(members)
        age = (now - max(_aware(r.get("updated_at")) for r, _ in members)).total_seconds()
        full = n >= a.group_size if a.group_size else n >= a.min_group_size
        if not full and age < a.group_wait_s:
            continue  # more runs of this task may still arrive
        if n >= a.min_group_size:
            chosen.append(members)
            count += n
        elif a.small_groups == "discard":
            for r, _ in members:
                sel.discarded[r["experience_id"]] = f"group of {n} < min_group_size {a.min_group_size}"
        elif a.small_groups == "batch":
            fallback.extend(members)
            count += n
            sel.small_groups += 1
    if count < cfg.train_batch_size:
        return
    items, gids = [], []
    for g, members in enumerate(chosen):
        for r, w in members:
            items.append(_item(r, w))
            gids.append(g)
    if items:
        adv = group_relative(torch.tensor([i.reward for i in items]), torch.tensor(gids), std_normalize=a.std_normalize)
        for it, v in zip(items, adv.tolist()):
            it.advantage = v
    if fallback:
        extra = [_item(r, w) for r, w in fallback]
        rewards = torch.tensor([i.reward for i in items + extra])
        adv = batch_relative(rewards, std_normalize=a.std_normalize)[len(items):]
        for it, v in zip(extra, adv.tolist()):
            it.advantage = v
        items += extra
    sel.items = items
