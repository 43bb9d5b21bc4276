"""The Explorer's writes: recording experiences, rewarding them (feedback) and committing them to training."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Sequence

from sqlalchemy import and_, delete, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.engine import Connection, Engine

from services.common.buffer.engine import _lock_rows, _lock_users, iter_chunks, user_hash, utcnow, write_transaction
from services.common.buffer.governance import _audit, _buried
from services.common.buffer.schema import (
    LATE_PENDING,
    TERMINAL,
    AlreadyConsumed,
    IdempotencyKeyReused,
    UnknownIds,
    _row_to_experience,
    deleted_users,
    experiences,
    feedback_keys,
    reward_ledger,
)
from services.common.records import Experience, ExperienceStatus

log = logging.getLogger(__name__)


def _now_row(**values: Any) -> dict:
    values["updated_at"] = utcnow()
    return values


def insert_experiences(*, engine: Engine, records: Sequence[Experience], audit: dict[str, Any] | None = None) -> int:
    """Insert a batch of new experiences in one transaction, with ``audit``'s row (actor, action,
    target, details) in the same transaction; returns how many were inserted. Never one deleted on
    request: neither a row deleted before (its tombstone) nor a user's record created before that
    user's data was deleted (``deleted_users``: a record still queued on some replica, or replayed)."""
    if not records:
        return 0
    with engine.connect() as conn:
        buried = _buried(conn, [r.experience_id for r in records])
    records = [r for r in records if r.experience_id not in buried]
    if not records:
        return 0
    now = utcnow()
    with write_transaction(engine) as conn:
        users = {r.user_id for r in records if r.user_id}
        if users:  # checked under the users' locks: a deletion is wholly before this insert or wholly after it
            _lock_users(conn, users)
            records = _not_forgotten(conn, records, now)
        if records:
            conn.execute(insert(experiences), [_row(r, now) for r in records])
        _audit(conn, audit)
    return len(records)


def _not_forgotten(conn: Connection, records: Sequence[Experience], now: Any) -> list[Experience]:
    """``records`` but those of a user whose data was deleted (for their agent) after they were created."""
    d = deleted_users.c
    hashes = {u: user_hash(u) for u in {r.user_id for r in records if r.user_id}}
    deletions: dict[str, list[tuple[str | None, datetime]]] = {}
    for chunk in iter_chunks(sorted(hashes.values()), 500):
        for user, agent, at in conn.execute(select(d.user_sha256, d.agent, d.deleted_at).where(d.user_sha256.in_(chunk))):
            deletions.setdefault(user, []).append((agent, at if at.tzinfo else at.replace(tzinfo=timezone.utc)))

    def forgotten(r: Experience) -> bool:
        created = r.created_at or now
        created = created if created.tzinfo else created.replace(tzinfo=timezone.utc)
        return any((agent is None or agent == r.agent) and created <= at
                   for agent, at in deletions.get(hashes.get(r.user_id or "", ""), ()))

    kept = [r for r in records if not forgotten(r)]
    if len(kept) < len(records):
        log.info("buffer: %d records of users whose data was deleted after they were made were not written",
                 len(records) - len(kept))
    return kept


def _row(record: Experience, now: Any) -> dict[str, Any]:
    row = record.model_dump(mode="python")
    row["status"] = record.status.value
    row["created_at"] = record.created_at or now
    row["updated_at"] = now
    return row


def insert_missing_experiences(*, engine: Engine, records: Sequence[Experience]) -> int:
    """Insert the records whose experience_id is not in the buffer yet (a retried batch, a replayed
    journal); returns how many were inserted."""
    if not records:
        return 0
    ids = [r.experience_id for r in records]
    with engine.connect() as conn:
        have: set[str] = _buried(conn, ids)
        for chunk in iter_chunks(ids, 500):
            have.update(conn.scalars(select(experiences.c.experience_id).where(experiences.c.experience_id.in_(chunk))))
    missing = [r for r in records if r.experience_id not in have]
    return insert_experiences(engine=engine, records=missing)


def _resolve(conn: Connection, msg_ids: Sequence[str], *, lock: bool, agents: Sequence[str] | None = None
             ) -> dict[str, list[tuple[str, str]]]:
    """Map each msg id (completion id or experience id) to its [(experience_id, status)].

    With ``lock``, the rows are locked (``_lock_rows``) and the statuses are the locked ones. With
    ``agents`` (an API key's), another agent's rows are not found: its ids are unknown to the caller,
    who learns nothing of them (not even that they exist).
    """
    ids = list(dict.fromkeys(msg_ids))
    found: dict[str, list[tuple[str, str]]] = {i: [] for i in ids}
    for chunk in iter_chunks(ids, 500):
        q = select(
            experiences.c.experience_id, experiences.c.completion_id, experiences.c.status
        ).where(or_(experiences.c.experience_id.in_(chunk), experiences.c.completion_id.in_(chunk)))
        if agents is not None:
            q = q.where(experiences.c.agent.in_(list(agents)))
        for exp_id, comp_id, status in conn.execute(q):
            if exp_id in found:
                found[exp_id].append((exp_id, status))
            if comp_id in found:
                found[comp_id].append((exp_id, status))
    if lock:
        current = _lock_rows(conn, {e for rows in found.values() for e, _ in rows})
        found = {i: [(e, current[e][0]) for e, _ in rows if e in current] for i, rows in found.items()}
    return found


def episode_experience_ids(*, engine: Engine, task_id: str, run_id: str, agent: str | None = None,
                           agents: Sequence[str] | None = None) -> list[str]:
    """The experience ids of every call of an episode (task_id + run_id), or of ``agent``'s calls in
    it (of ``agents``' only, an API key's), in arrival order."""
    e = experiences.c
    q = select(e.experience_id).where(e.task_id == task_id, e.run_id == run_id).order_by(e.seq)
    if agent is not None:
        q = q.where(e.agent == agent)
    if agents is not None:
        q = q.where(e.agent.in_(list(agents)))
    with engine.connect() as conn:
        return list(conn.scalars(q))


def find_unknown_ids(*, engine: Engine, msg_ids: Sequence[str], agents: Sequence[str] | None = None) -> list[str]:
    """The msg ids that name no recorded completion or experience (of ``agents``, when given)."""
    with engine.connect() as conn:
        found = _resolve(conn, msg_ids, lock=False, agents=agents)
    return [i for i, rows in found.items() if not rows]


@dataclass
class FeedbackResult:
    experience_ids: list[str]
    late: list[str] = field(default_factory=list)  # of them, those already trained on or discarded: recorded late
    hint_not_kept: list[str] = field(default_factory=list)  # of them, those whose hint came too late to teach
    demonstration_ids: list[str] = field(default_factory=list)  # the corrections it stored, as demonstrations
    replayed: bool = False  # an earlier feedback with the same idempotency key did all this: nothing changed now


@dataclass(frozen=True)
class IdempotencyKey:
    """A feedback's idempotency key: ``key`` of API key ``actor``, for a body of digest ``request_hash``;
    kept ``ttl_s`` seconds."""

    actor: str
    key: str
    request_hash: str
    ttl_s: float = 86_400.0


def feedback_rows(*, engine: Engine, msg_ids: Sequence[str], agents: Sequence[str] | None = None) -> list[Experience]:
    """The experiences the ids name (completion or experience ids), in arrival order; UnknownIds if
    any names nothing (or, with ``agents``, another agent's). What feedback in words is rendered from
    (their conversations)."""
    with engine.connect() as conn:
        found = _resolve(conn, msg_ids, lock=False, agents=agents)
        if unknown := [i for i, rows in found.items() if not rows]:
            raise UnknownIds(unknown)
        ids = sorted({e for rows in found.values() for e, _ in rows})
        rows = [r for chunk in iter_chunks(ids, 500)
                for r in conn.execute(select(experiences).where(experiences.c.experience_id.in_(chunk)))]
    return [_row_to_experience(r) for r in sorted(rows, key=lambda r: r.seq)]


def apply_feedback(
    *,
    engine: Engine,
    msg_ids: Sequence[str],
    reward: float | None,
    feedback: dict[str, Any],
    task_id: str | None = None,
    run_id: str | None = None,
    agents: Sequence[str] | None = None,
    audit: dict[str, Any] | None = None,
    hints: dict[str, dict[str, Any]] | None = None,
    corrections: Sequence[Experience] = (),
    idempotency: IdempotencyKey | None = None,
) -> FeedbackResult:
    """Set the reward of every experience the ids name, all or nothing; with ``hints``
    ({experience_id: hint}), each named experience's hint too (``None`` reward: the hint alone, the
    reward and ``feedback`` note left as they were). Either makes a recorded row rewarded (it has
    feedback, and can be committed).

    Every reward is also a row of ``reward_ledger``. One for an experience already trained on (or
    discarded) is late: it still becomes the experience's reward (the latest is what the release gate
    and the canary read), its status stays, and the ledger says it came late (``FeedbackResult.late``).

    A hint for an experience already trained on (or discarded) is not kept (``hint_not_kept``); words
    alone for one raise AlreadyConsumed. Raises UnknownIds if any id names nothing, or, with ``agents``,
    another agent's experience (the caller's key learns nothing about it); in each case nothing changes. ``audit``: a row for ``audit_log`` (actor, action,
    target, details), written in the same transaction.

    ``corrections``: demonstrations to store with it (a correction of a named call), in the same
    transaction. ``idempotency``: a key this feedback is sent under; if the actor used it before, the
    earlier result comes back (``replayed``) and nothing changes, or IdempotencyKeyReused if that was
    another body.
    """
    if idempotency is not None and (done := _keyed(engine, idempotency)) is not None:
        return done
    try:
        return _apply_feedback(engine, msg_ids=msg_ids, reward=reward, feedback=feedback, task_id=task_id, run_id=run_id,
                               agents=agents, audit=audit, hints=hints, corrections=corrections, idempotency=idempotency)
    except IntegrityError:
        if idempotency is not None and (done := _keyed(engine, idempotency)) is not None:
            return done  # the same key, sent twice at once: the other one wrote it first
        raise


def replayed_feedback(*, engine: Engine, idempotency: IdempotencyKey) -> FeedbackResult | None:
    """What the feedback first sent under this key did (``replayed``), None if none was; raises
    IdempotencyKeyReused if that feedback had another body."""
    return _keyed(engine, idempotency)


def _keyed(conn_or_engine: Connection | Engine, idempotency: IdempotencyKey) -> FeedbackResult | None:
    """What an earlier feedback under this key did (``replayed``), or None if there was none."""
    k = feedback_keys.c
    q = select(k.request_hash, k.result).where(  # an expired key is forgotten, pruned or not yet
        k.actor == idempotency.actor, k.key == idempotency.key,
        k.created_at >= utcnow() - timedelta(seconds=idempotency.ttl_s))
    if isinstance(conn_or_engine, Connection):
        row = conn_or_engine.execute(q).first()
    else:
        with conn_or_engine.connect() as conn:
            row = conn.execute(q).first()
    if row is None:
        return None
    if row.request_hash != idempotency.request_hash:
        raise IdempotencyKeyReused(idempotency.key)
    return FeedbackResult(**{**row.result, "replayed": True})


def _apply_feedback(engine: Engine, *, msg_ids: Sequence[str], reward: float | None, feedback: dict[str, Any],
                    task_id: str | None, run_id: str | None, agents: Sequence[str] | None, audit: dict[str, Any] | None,
                    hints: dict[str, dict[str, Any]] | None, corrections: Sequence[Experience],
                    idempotency: IdempotencyKey | None) -> FeedbackResult:
    with write_transaction(engine) as conn:
        # a correction holds its user's words: taken before the row locks, as a deletion takes it
        _lock_users(conn, {c.user_id for c in corrections if c.user_id})
        found = _resolve(conn, msg_ids, lock=True, agents=agents)
        if idempotency is not None and (done := _keyed(conn, idempotency)) is not None:
            return done  # sent again while the first held these rows' locks: its answer, whatever changed since
        unknown = [i for i, rows in found.items() if not rows]
        if unknown:
            raise UnknownIds(unknown)
        targets = sorted({e for rows in found.values() for e, _ in rows})
        frozen = sorted({e for rows in found.values() for e, s in rows if s in TERMINAL})
        if frozen and hints is not None and reward is None:
            raise AlreadyConsumed(frozen)  # words alone, for what was trained already: nothing to keep
        if reward is None and hints is None and not corrections:
            raise ValueError("apply_feedback needs a reward, hints or corrections")
        if hints is not None and (missing := sorted(set(targets) - set(hints))):
            raise ValueError(f"no hint given for {', '.join(missing)}")  # a caller's bug: every target gets one
        values = _now_row() if reward is None else _now_row(reward=float(reward), feedback=feedback)
        if task_id is not None:
            values["task_id"] = task_id
        if run_id is not None:
            values["run_id"] = run_id
        touched = reward is not None or hints is not None  # a correction alone leaves the call as it was
        live = [e for e in targets if e not in set(frozen)] if touched else []
        for e in live if hints is not None else ():  # a purged row keeps no words (nor their token ids)
            conn.execute(update(experiences).where(experiences.c.experience_id == e, experiences.c.purged_at.is_(None))
                         .values(hint=hints[e]))
        # Recorded rows become rewarded; committed ones keep their status and take the new reward.
        for chunk in iter_chunks(live, 500):
            base = experiences.c.experience_id.in_(chunk)
            conn.execute(
                update(experiences)
                .where(base, experiences.c.status == ExperienceStatus.RECORDED.value)
                .values(status=ExperienceStatus.REWARDED.value, **values)
            )
            conn.execute(
                update(experiences)
                .where(base, experiences.c.status != ExperienceStatus.RECORDED.value)
                .values(**values)
            )
        # Trained (or discarded) rows take the late reward alone: their grouping, note and lineage stay as trained.
        for chunk in iter_chunks(frozen if reward is not None else [], 500):
            conn.execute(update(experiences).where(experiences.c.experience_id.in_(chunk))
                         .values(reward=float(reward), updated_at=values["updated_at"]))
        if reward is not None:
            statuses = {e: s for rows in found.values() for e, s in rows}  # as they were, locked
            _ledger(conn, statuses, reward=float(reward), feedback=feedback, audit=audit, at=values["updated_at"])
        if corrections and (kept := _not_forgotten(conn, corrections, values["updated_at"])):
            conn.execute(insert(experiences), [_row(c, values["updated_at"]) for c in kept])
        _audit(conn, audit, count=len(targets), **({"demonstrations": [c.experience_id for c in corrections]}
                                                     if corrections else {}))
        result = FeedbackResult(experience_ids=targets if reward is not None or hints is not None else [],
                                late=frozen if reward is not None else [], hint_not_kept=frozen if hints is not None else [],
                                demonstration_ids=[c.experience_id for c in corrections])
        if idempotency is not None:
            at = values["updated_at"]
            # expired keys go, and this one replaces its own expired row if it had one
            conn.execute(delete(feedback_keys).where(feedback_keys.c.created_at < at - timedelta(seconds=idempotency.ttl_s)))
            result_row = {k: v for k, v in asdict(result).items() if k != "replayed"}
            conn.execute(insert(feedback_keys).values(actor=idempotency.actor, key=idempotency.key,
                                                      request_hash=idempotency.request_hash, result=result_row, created_at=at))
    return result


def _ledger(conn: Connection, statuses: dict[str, str], *, reward: float, feedback: dict[str, Any],
            audit: dict[str, Any] | None, at: Any) -> None:
    """One ``reward_ledger`` row per experience (``statuses``: its status before this reward): this
    reward, and whether it came after training."""
    e = experiences.c
    rows = []
    for chunk in iter_chunks(sorted(statuses), 500):
        for exp_id, agent, trained_in in conn.execute(
                select(e.experience_id, e.agent, e.trained_in).where(e.experience_id.in_(chunk))):
            status = statuses[exp_id]
            late = status in TERMINAL
            rows.append({"experience_id": exp_id, "agent": agent, "reward": reward,
                         "source": _cut(feedback.get("source")), "actor": _cut((audit or {}).get("actor")), "late": late, "status_at": status,
                         "trained_in": trained_in if late else None, "outcome": LATE_PENDING if late else "applied",
                         "created_at": at})
    if rows:  # in one order on every database: the ledger's ids follow the experience ids
        conn.execute(insert(reward_ledger), sorted(rows, key=lambda r: r["experience_id"]))


def _cut(text: str | None, width: int = 128) -> str | None:
    return None if text is None else str(text)[:width]


def reward_history(*, engine: Engine, experience_id: str) -> list[dict[str, Any]]:
    """Every reward sent for one experience, oldest first (its ``reward`` is the last)."""
    return reward_histories(engine=engine, experience_ids=[experience_id])[experience_id]


def reward_histories(*, engine: Engine, experience_ids: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """``reward_history`` of each of ``experience_ids`` (an empty list for one without a reward), in
    one query per 500 ids."""
    r = reward_ledger.c
    out: dict[str, list[dict[str, Any]]] = {i: [] for i in experience_ids}
    with engine.connect() as conn:
        for chunk in iter_chunks(sorted(out), 500):
            q = select(r.experience_id, r.reward, r.source, r.actor, r.late, r.status_at, r.trained_in, r.outcome,
                       r.created_at).where(r.experience_id.in_(chunk)).order_by(r.id)
            for row in conn.execute(q):
                entry = dict(row._mapping)
                out[entry.pop("experience_id")].append(entry)
    return out


def commit_experiences(
    *, engine: Engine, task_id: str | None = None, msg_ids: Sequence[str] | None = None,
    agents: Sequence[str] | None = None, audit: dict[str, Any] | None = None,
) -> int:
    """Mark rewarded experiences committed (visible to the Trainer); returns how many.

    With ``msg_ids``, only the experiences they name (unknown ids raise UnknownIds and change
    nothing); with ``task_id``, only that task's; with neither, every rewarded experience. An
    empty ``msg_ids`` names nothing and commits nothing. ``agents``: only these agents' rows
    (another agent's ids are unknown ids). ``audit``: as in ``apply_feedback``.
    """
    if msg_ids is not None and not msg_ids:
        return 0
    with write_transaction(engine) as conn:
        conds = [experiences.c.status == ExperienceStatus.REWARDED.value]
        if task_id is not None:
            conds.append(experiences.c.task_id == task_id)
        if agents is not None:
            conds.append(experiences.c.agent.in_(list(agents)))
        untrainable = experiences.c.trainable.is_(False)
        if msg_ids:
            found = _resolve(conn, msg_ids, lock=False, agents=agents)
            unknown = [i for i, rows in found.items() if not rows]
            if unknown:
                raise UnknownIds(unknown)
            targets = {e for rows in found.values() for e, _ in rows}
        else:
            targets = set(conn.scalars(select(experiences.c.experience_id).where(and_(*conds))))
        # Lock first, in the common order, then update only what is still rewarded once locked.
        locked = _lock_rows(conn, targets)
        chosen = sorted(e for e, (status, _) in locked.items() if status == ExperienceStatus.REWARDED.value)
        n = 0
        for chunk in iter_chunks(chosen, 500):
            mine = and_(*conds, experiences.c.experience_id.in_(chunk))
            result = conn.execute(
                update(experiences).where(mine, ~untrainable).values(**_now_row(status=ExperienceStatus.COMMITTED.value))
            )
            n += result.rowcount or 0
            # Recorded for audit only (no consent, or redacted without ids): done with, never trained.
            conn.execute(update(experiences).where(mine, untrainable).values(**_now_row(status=ExperienceStatus.DISCARDED.value)))
        _audit(conn, audit, committed=n)
        return n
