"""From committed buffer rows to one training batch: what every objective shares.

Pure logic over what ``buffer.fetch_committed`` returns, so every rule is unit-tested without a
database. Rows without a reward or with broken logprobs are discarded, stale rows are discarded or
down-weighted; then the agent's recipe (services/trainer/recipes/) picks the batch and, where it
needs them, computes advantages. Rows neither trained on nor discarded stay committed for later.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from services.common.records import CommittedExperience

if TYPE_CHECKING:
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
    advantage: float | None = None  # set at selection by recipes that know it then (GRPO)
    run_id: str | None = None


@dataclass(frozen=True)
class Norms:
    """Batch-wide denominators, so every shard's loss is its share of the batch's mean."""

    tokens: float
    sequences: float

    @classmethod
    def of(cls, items: list[TrainItem]) -> "Norms":
        return cls(tokens=float(sum(len(i.response_ids) for i in items)), sequences=float(len(items)))


@dataclass
class Selection:
    items: list[TrainItem] = field(default_factory=list)
    discarded: dict[str, str] = field(default_factory=dict)  # experience id -> why
    stale_downweighted: int = 0
    small_groups: int = 0

    @property
    def ready(self) -> bool:
        return bool(self.items)


# A committed row that passed the shared checks, with its staleness weight.
Usable = tuple[CommittedExperience, float]


def aware(t: datetime | None) -> datetime:
    if t is None:
        return datetime.now(timezone.utc)
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def to_item(row: CommittedExperience, weight: float) -> TrainItem:
    temperature = float((row.sampling or {}).get("temperature") or 0.0)
    return TrainItem(
        experience_id=row.experience_id,
        task_id=row.task_id,
        run_id=row.run_id,
        model_version=int(row.model_version),
        prompt_ids=list(row.prompt_token_ids),
        response_ids=list(row.response_token_ids),
        old_logprobs=[float(x) for x in row.response_logprobs],
        reward=float(row.reward),
        temperature=temperature if temperature > 0 else 1.0,  # greedy samples were scored at T=1
        weight=weight,
    )


def select_batch(
    rows: list[CommittedExperience], *, cfg: "TrainerConfig", current_version: int, now: datetime | None = None
) -> Selection:
    """Pick the next batch of ``rows`` (oldest first) for one agent at ``current_version``."""
    from services.trainer.recipes import recipe_for

    recipe = recipe_for(cfg.algorithm.name)
    sel = Selection()
    st = cfg.staleness
    usable: list[Usable] = []
    for row in rows:
        lag = current_version - int(row.model_version)
        if row.reward is None:
            sel.discarded[row.experience_id] = "no reward"
            continue
        if not row.response_token_ids or len(row.response_token_ids) != len(row.response_logprobs):
            sel.discarded[row.experience_id] = "empty response or logprobs of another length"
            continue
        weight = 1.0
        if lag > st.max_staleness:
            if st.policy == "discard":
                sel.discarded[row.experience_id] = f"stale: made by v{row.model_version}, {lag} versions behind"
                continue
            weight = st.downweight ** (lag - st.max_staleness)
            sel.stale_downweighted += 1
        if (why := recipe.refuses(row, cfg)) is not None:
            sel.discarded[row.experience_id] = why
            continue
        usable.append((row, weight))
    recipe.select(usable, cfg=cfg, now=aware(now), sel=sel)
    return sel


def take_oldest(usable: list[Usable], *, cfg: "TrainerConfig", sel: Selection) -> None:
    """The plain rule: the oldest ``train_batch_size`` usable rows, once that many are there."""
    size = cfg.train_batch_size
    if len(usable) >= size:
        sel.items = [to_item(r, w) for r, w in usable[:size]]
