"""Reading the buffer for the APIs, the dashboard, reports and back-pressure: single experiences,
filtered lists, counts and reward histories. Nothing here writes."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Sequence

from sqlalchemy import and_, func, select
from sqlalchemy.engine import Engine

from services.common.buffer.schema import _DEMONSTRATION, _row_to_experience, experiences
from services.common.records import Experience, ExperienceStatus


def get_experience(*, engine: Engine, experience_id: str) -> Experience | None:
    with engine.connect() as conn:
        row = conn.execute(
            select(experiences).where(experiences.c.experience_id == experience_id)
        ).first()
    return _row_to_experience(row) if row else None


def list_experiences(
    *,
    engine: Engine,
    task_id: str | None = None,
    status: str | None = None,
    agent: str | None = None,
    completion_id: str | None = None,
    limit: int = 100,
    offset: int = 0,
    newest_first: bool = False,
) -> list[Experience]:
    """Experiences matching the filters, oldest first (or newest first)."""
    conds = []
    if task_id is not None:
        conds.append(experiences.c.task_id == task_id)
    if status is not None:
        conds.append(experiences.c.status == status)
    if agent is not None:
        conds.append(experiences.c.agent == agent)
    if completion_id is not None:
        conds.append(experiences.c.completion_id == completion_id)
    seq = experiences.c.seq.desc() if newest_first else experiences.c.seq
    q = select(experiences).order_by(seq).limit(limit).offset(offset)
    if conds:
        q = q.where(and_(*conds))
    with engine.connect() as conn:
        return [_row_to_experience(r) for r in conn.execute(q)]


@dataclass(frozen=True)
class RewardPoint:
    created_at: datetime
    model_version: int
    reward: float
    status: str


def rewarded_history(*, engine: Engine, agent: str) -> list[RewardPoint]:
    """Every rewarded experience of ``agent``, oldest first (reports and plots)."""
    e = experiences.c
    q = (select(e.created_at, e.model_version, e.reward, e.status)
         .where(e.agent == agent, e.reward.is_not(None)).order_by(e.created_at))
    with engine.connect() as conn:
        return [RewardPoint(*r) for r in conn.execute(q)]


def count_versions_served(*, engine: Engine, agent: str, newer_than: int, with_task_only: bool = True) -> int:
    """How many distinct versions newer than ``newer_than`` produced experiences of ``agent``; by
    default only experiences carrying a task id. A task id does not mean traffic: release
    evaluations carry one too (``release-eval/...``), so a version only evaluated is counted."""
    e = experiences.c
    conds = [e.agent == agent, e.model_version > newer_than]
    if with_task_only:
        conds.append(e.task_id.is_not(None))
    with engine.connect() as conn:
        return int(conn.execute(select(func.count(func.distinct(e.model_version))).where(*conds)).scalar() or 0)


def count_by_status(*, engine: Engine, agent: str | None = None) -> dict[str, int]:
    q = select(experiences.c.status, func.count()).group_by(experiences.c.status)
    if agent is not None:
        q = q.where(experiences.c.agent == agent)
    with engine.connect() as conn:
        return {status: n for status, n in conn.execute(q)}


def committed_backlog(*, engine: Engine, agents: Sequence[str], cap: int) -> dict[str, int]:
    """Committed rollouts waiting for the Trainer, per agent (demonstrations, which stay committed,
    aside), counted up to ``cap``: the cost stays that of ``cap`` index entries however long the
    backlog grows."""
    e = experiences.c
    out = {}
    with engine.connect() as conn:
        for agent in agents:
            waiting = (select(e.seq).where(e.agent == agent, e.status == ExperienceStatus.COMMITTED.value, ~_DEMONSTRATION)
                       .limit(cap).subquery())
            out[agent] = conn.execute(select(func.count()).select_from(waiting)).scalar_one()
    return out
