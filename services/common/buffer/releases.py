"""Releases: decisions about which version serves, and the online rewards they rest on."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import func, insert, or_, select
from sqlalchemy.engine import Engine

from services.common.buffer.engine import utcnow, write_transaction
from services.common.buffer.governance import _audit
from services.common.buffer.schema import _DEMONSTRATION, _row_to_experience, experiences, release_decisions
from services.common.records import EVAL_TASK_PREFIX, Experience, ReleaseDecision


def record_decision(
    *, engine: Engine, agent: str, version: int, decision: str, serving: int | None, actor: str,
    reason: str | None = None, figures: dict[str, Any] | None = None, audit: dict[str, Any] | None = None,
) -> ReleaseDecision:
    """Record a release decision (who decided what about which version, with the figures), and
    ``audit``'s row (a decision by hand: the key that took it) in the same transaction."""
    now = utcnow()
    with write_transaction(engine) as conn:
        row_id = conn.execute(insert(release_decisions).values(
            agent=agent, version=version, decision=decision, serving=serving, actor=actor,
            reason=None if reason is None else reason[:2000], figures=figures, created_at=now,
        )).inserted_primary_key[0]
        _audit(conn, audit)
    return ReleaseDecision(id=int(row_id), agent=agent, version=version, decision=decision, serving=serving,
                           actor=actor, reason=reason, figures=figures, created_at=now)


def list_decisions(*, engine: Engine, agent: str | None = None, version: int | None = None,
                   limit: int = 1000) -> list[ReleaseDecision]:
    """Release decisions, oldest first (the newest ``limit``)."""
    d = release_decisions.c
    q = select(release_decisions).order_by(d.id.desc()).limit(limit)
    if agent is not None:
        q = q.where(d.agent == agent)
    if version is not None:
        q = q.where(d.version == version)
    with engine.connect() as conn:
        rows = [ReleaseDecision(**r._mapping) for r in conn.execute(q)]
    return rows[::-1]


def newest_decided_version(*, engine: Engine, agent: str) -> int:
    """The highest version any release decision names (0 without any)."""
    with engine.connect() as conn:
        return conn.scalar(select(func.max(release_decisions.c.version)).where(release_decisions.c.agent == agent)) or 0


def recent_rewarded(*, engine: Engine, agent: str, limit: int) -> list[Experience]:
    """The newest ``limit`` rewarded calls of ``agent`` (traffic only: no demonstrations, no release
    evaluations, none whose text retention purged), newest first."""
    e = experiences.c
    q = (select(experiences).where(e.agent == agent, e.reward.is_not(None), ~_DEMONSTRATION, e.purged_at.is_(None),
                                   or_(e.task_id.is_(None), ~e.task_id.startswith(EVAL_TASK_PREFIX)))
         .order_by(e.seq.desc()).limit(limit))
    with engine.connect() as conn:
        return [_row_to_experience(r) for r in conn.execute(q)]


def version_rewards(*, engine: Engine, agent: str, version: int, since: datetime | None = None,
                    limit: int = 2000) -> list[float]:
    """The online rewards ``version`` of ``agent`` earned, one per episode (the reward of its last
    rewarded call; a call without a run id is its own episode), the most recent ``limit`` episodes.
    Demonstrations and release evaluations are not traffic and are left out."""
    e = experiences.c
    q = (select(e.experience_id, e.task_id, e.run_id, e.seq, e.reward)
         .where(e.agent == agent, e.model_version == version, e.reward.is_not(None), ~_DEMONSTRATION,
                or_(e.task_id.is_(None), ~e.task_id.startswith(EVAL_TASK_PREFIX)))
         .order_by(e.seq.desc()).limit(limit * 8))
    if since is not None:
        q = q.where(e.created_at >= since)
    episodes: dict[tuple, float] = {}
    with engine.connect() as conn:
        for exp_id, task, run, _seq, reward in conn.execute(q):  # newest first: the first seen is the last call
            key = (task, run) if run is not None else (None, exp_id)
            if key not in episodes:
                if len(episodes) >= limit:
                    break
                episodes[key] = float(reward)
    return list(episodes.values())
