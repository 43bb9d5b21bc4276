"""Governance: the audit log, retention of raw text, and deleting a user's data on request."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Callable, Sequence

from sqlalchemy import and_, insert, select, update
from sqlalchemy.engine import Connection, Engine

from services.common.buffer.engine import _lock_rows, _lock_users, iter_chunks, user_hash, utcnow, write_transaction
from services.common.buffer.schema import TERMINAL, audit_log, deleted_users, experiences, reward_ledger, tombstones
from services.common.records import ExperienceStatus


def _audit(conn: Connection, audit: dict[str, Any] | None, **details: Any) -> None:
    if audit is not None:
        conn.execute(insert(audit_log).values(
            actor=audit["actor"], action=audit["action"], target=audit.get("target"),
            details={**(audit.get("details") or {}), **details}, created_at=utcnow()))


def list_audit(*, engine: Engine, limit: int = 100, actor: str | None = None, action: str | None = None,
               visible: Callable[[dict[str, Any]], bool] | None = None, scan_max: int = 100_000) -> list[dict[str, Any]]:
    """The newest ``limit`` audit rows, newest first; with ``visible``, only the rows it allows (read
    page by page, at most ``scan_max`` rows looked at)."""
    rows: list[dict[str, Any]] = []
    before, scanned = None, 0
    page = limit if visible is None else max(limit, 500)
    with engine.connect() as conn:
        while len(rows) < limit and scanned < scan_max:
            q = select(audit_log).order_by(audit_log.c.id.desc()).limit(page)
            if actor is not None:
                q = q.where(audit_log.c.actor == actor)
            if action is not None:
                q = q.where(audit_log.c.action == action)
            if before is not None:
                q = q.where(audit_log.c.id < before)
            batch = [dict(r._mapping) for r in conn.execute(q)]
            scanned += len(batch)
            rows += batch if visible is None else [r for r in batch if visible(r)]
            if len(batch) < page or visible is None:
                break
            before = batch[-1]["id"]
    rows = rows[:limit]
    for r in rows:  # SQLite hands back naive datetimes: they were written in UTC
        t = r["created_at"]
        r["created_at"] = (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).isoformat()
    return rows


def _buried(conn: Connection, ids: Sequence[str]) -> set[str]:
    found: set[str] = set()
    for chunk in iter_chunks(list(ids), 500):
        found.update(conn.scalars(select(tombstones.c.experience_id).where(tombstones.c.experience_id.in_(chunk))))
    return found



_PURGED_TEXT = dict(prompt_token_ids=[], response_token_ids=[], response_logprobs=[], messages=[], response={},
                    tools=None, hint=None)


def purge_text(*, engine: Engine, before: datetime, limit: int = 5_000) -> int:
    """Remove the raw text of experiences created before ``before``: messages, response, tools and
    the token ids (which decode to the same text). Rewards, versions, agents, task and user ids,
    statuses and lineage stay, so aggregates and ``trained_in`` still answer. Rows not trained yet
    can no longer be, and become discarded. At most ``limit`` rows per call (call until it returns 0)."""
    e = experiences.c
    with write_transaction(engine) as conn:
        ids = list(conn.scalars(select(e.experience_id).where(e.created_at < before, e.purged_at.is_(None)).limit(limit)))
        if not ids:
            return 0
        locked = _lock_rows(conn, ids)
        now = utcnow()
        purged = 0
        for chunk in iter_chunks(sorted(locked), 500):
            # still unpurged once locked: another replica's pass that got there first is not counted twice
            base = and_(e.experience_id.in_(chunk), e.purged_at.is_(None))
            purged += conn.execute(update(experiences).where(base, e.status.in_(TERMINAL))
                                   .values(**_PURGED_TEXT, trainable=False, purged_at=now, updated_at=now)).rowcount
            purged += conn.execute(update(experiences).where(base, e.status.notin_(TERMINAL))
                                   .values(**_PURGED_TEXT, trainable=False, purged_at=now, updated_at=now,
                                           status=ExperienceStatus.DISCARDED.value)).rowcount
        return purged


def delete_user_data(*, engine: Engine, user_id: str, agents: Sequence[str] | None = None,
                     audit: dict[str, Any] | None = None) -> dict[str, Any]:
    """Delete every experience of ``user_id`` (whatever its status: not-yet-trained batches included;
    a Trainer step that had read one is refused at its commit and retried without it). Returns
    what was removed, by status and agent, and which published versions were already trained on
    some of it (that cannot be taken out of an adapter; it is named so it can be retrained)."""
    e = experiences.c
    with write_transaction(engine) as conn:
        _lock_users(conn, [user_id])  # an insert of this user's rows is wholly before or wholly after this
        # what some replica writes later, made before now, is dropped on insert (services/common/buffer/recording.py)
        marks = [{"user_sha256": user_hash(user_id), "agent": a, "deleted_at": utcnow()}
                 for a in (sorted(set(agents)) if agents is not None else [None])]
        if marks:  # none for a key limited to no agent: it deletes nothing
            conn.execute(insert(deleted_users), marks)
        mine = [e.user_id == user_id] + ([e.agent.in_(list(agents))] if agents is not None else [])
        ids = list(conn.scalars(select(e.experience_id).where(*mine)))
        _lock_rows(conn, ids)
        # Read once locked: a Trainer step that committed meanwhile shows as consumed, with its version.
        rows = []
        for chunk in iter_chunks(ids, 500):
            rows += conn.execute(select(e.experience_id, e.status, e.agent, e.trained_in, e.model_version, e.created_at)
                                 .where(e.experience_id.in_(chunk)))
        by_status: dict[str, int] = {}
        trained: dict[tuple[str, int], int] = {}
        for r in rows:
            by_status[r.status] = by_status.get(r.status, 0) + 1
            if r.status == ExperienceStatus.CONSUMED.value and r.trained_in is not None:
                trained[(r.agent, r.trained_in)] = trained.get((r.agent, r.trained_in), 0) + 1
        now = utcnow()
        where = {r.experience_id: r for r in rows}
        for chunk in iter_chunks(list(where), 500):
            conn.execute(experiences.delete().where(e.experience_id.in_(chunk)))
            conn.execute(reward_ledger.delete().where(reward_ledger.c.experience_id.in_(chunk)))
            fresh = set(chunk) - _buried(conn, chunk)
            if fresh:  # where each row was: the dashboard's rollups compute that minute again
                conn.execute(insert(tombstones), [
                    {"experience_id": i, "deleted_at": now, "agent": where[i].agent,
                     "model_version": where[i].model_version, "created_at": where[i].created_at}
                    for i in sorted(fresh)])
        report = {
            "user_id": user_id, "deleted": len(rows), "by_status": by_status,
            "in_published_versions": [{"agent": a, "version": v, "experiences": n} for (a, v), n in sorted(trained.items())],
        }
        _audit(conn, audit, deleted=len(rows), by_status=by_status,
               in_published_versions=report["in_published_versions"])
        return report
