"""The SQL experience buffer: tables and every query the services run against them.

SQLAlchemy Core over any SQL database (SQLite with WAL by default, PostgreSQL in production).
Functions take keyword arguments and either an Engine (they open their own transaction) or a
Connection already inside one. Nothing here assumes SQLite: row locks use ``FOR UPDATE`` (ignored
by SQLite, which serialises writers anyway), and SQLite write transactions start with
``BEGIN IMMEDIATE`` so two writers never deadlock upgrading a read lock. On PostgreSQL every writer
locks the rows it changes before changing them, always in ascending experience_id order
(``_lock_rows``), so concurrent writers (Explorer replicas, the Trainer) queue instead of deadlocking.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    and_,
    create_engine,
    event,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Connection, Engine, make_url

from services.common.records import (
    DEMONSTRATION_KIND,
    CommittedExperience,
    Experience,
    ExperienceStatus,
    ReleaseDecision,
    TeamEpisode,
    TrainerStep,
)

log = logging.getLogger(__name__)

metadata = MetaData()

_ID = BigInteger().with_variant(Integer, "sqlite")  # SQLite autoincrements INTEGER keys only

experiences = Table(
    "experiences",
    metadata,
    Column("seq", _ID, primary_key=True, autoincrement=True),
    Column("experience_id", String(96), nullable=False, unique=True),
    Column("completion_id", String(96), nullable=False, index=True),
    Column("agent", String(128), nullable=False),
    Column("model_version", Integer, nullable=False),
    Column("task_id", String(256), index=True),
    Column("run_id", String(128)),
    Column("prompt_token_ids", JSON, nullable=False),
    Column("response_token_ids", JSON, nullable=False),
    Column("response_logprobs", JSON, nullable=False),
    Column("messages", JSON, nullable=False),
    Column("response", JSON, nullable=False),
    Column("tools", JSON),
    Column("finish_reason", String(32)),
    Column("sampling", JSON, nullable=False),
    Column("reward", Float),
    Column("feedback", JSON),
    Column("status", String(16), nullable=False, index=True),
    Column("trained_in", Integer),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
    # Added after the first release: _migrate adds them to older databases (nullable, no default).
    Column("user_id", String(256), index=True),  # whose traffic this is (metadata.user_id or a header)
    Column("request_id", String(64)),  # the HTTP request that produced it (X-Request-Id, also in the logs)
    Column("trainable", Boolean),  # false: never trained (consent, redaction); null: trainable
    Column("privacy", JSON),  # redactions and consent: what was done to this record and why
    Column("purged_at", DateTime(timezone=True)),  # when retention removed its raw text (purge_text)
)

# Index used by the Trainer's poll: committed rows of one agent in arrival order.
Index("ix_experiences_created_purged", experiences.c.created_at, experiences.c.purged_at)
Index("ix_experiences_agent_status_seq", experiences.c.agent, experiences.c.status, experiences.c.seq)

trainer_steps = Table(
    "trainer_steps",
    metadata,
    Column("id", _ID, primary_key=True, autoincrement=True),
    Column("agent", String(128), nullable=False, index=True),
    Column("step", Integer, nullable=False),
    Column("version", Integer, nullable=False),
    Column("consumed", Integer, nullable=False),
    Column("discarded", Integer, nullable=False),
    Column("state_ref", String(512)),
    Column("metrics", JSON),
    Column("created_at", DateTime(timezone=True), nullable=False),
)

# Every decision about which version serves (release policy, rollbacks), with who took it and why.
release_decisions = Table(
    "release_decisions",
    metadata,
    Column("id", _ID, primary_key=True, autoincrement=True),
    Column("agent", String(128), nullable=False),
    Column("version", Integer, nullable=False),  # the version the decision is about
    Column("decision", String(32), nullable=False),  # candidate, canary_started, promoted, rejected, rolled_back, alarm
    Column("serving", Integer),  # the version that serves once the decision is carried out
    Column("actor", String(128), nullable=False),  # gate, canary, guard, trainer, admin:<key name>, cli
    Column("reason", String(2000)),
    Column("figures", JSON),  # the test's statistics: sample sizes, means, bounds
    Column("created_at", DateTime(timezone=True), nullable=False),
)
Index("ix_release_decisions_agent_id", release_decisions.c.agent, release_decisions.c.id)
# Per-version reward statistics (canary, guard) without scanning an agent's whole history.
Index("ix_experiences_agent_version", experiences.c.agent, experiences.c.model_version)
# A version's lineage (the experiences it was trained on) at publication, without a scan.
Index("ix_experiences_agent_trained_in", experiences.c.agent, experiences.c.trained_in, experiences.c.status)

# An agent's newest experiences first (the dashboard's lists), whatever the planner's statistics.
Index("ix_experiences_agent_seq", experiences.c.agent, experiences.c.seq)
# The dashboard's aggregates per agent (over time, per version) read this index alone, never the rows.
Index("ix_experiences_dashboard", experiences.c.agent, experiences.c.model_version, experiences.c.created_at,
      experiences.c.status, experiences.c.reward)

# Who did what through the admin and feedback endpoints.
audit_log = Table(
    "audit_log",
    metadata,
    Column("id", _ID, primary_key=True, autoincrement=True),
    Column("actor", String(128), nullable=False),  # the API key's name, or "anonymous" without keys
    Column("action", String(64), nullable=False),
    Column("target", JSON),
    Column("details", JSON),
    Column("created_at", DateTime(timezone=True), nullable=False, index=True),
)

# Experiences deleted on request (a user's data): a replayed journal or a retried batch never
# writes them again.
tombstones = Table(
    "tombstones",
    metadata,
    Column("experience_id", String(96), primary_key=True),
    Column("deleted_at", DateTime(timezone=True), nullable=False),
)

TERMINAL = (ExperienceStatus.CONSUMED.value, ExperienceStatus.DISCARDED.value)
_EVAL_TASK_PREFIX = "release-eval/"  # services.common.release.EVAL_TASK_PREFIX (evaluation traffic)


class BufferError(Exception):
    """Base of the errors a buffer call reports to its caller."""


class UnknownIds(BufferError):
    def __init__(self, ids: Sequence[str]):
        self.ids = list(ids)
        super().__init__(f"unknown id(s): {', '.join(self.ids)}")


class ForbiddenAgents(BufferError):
    """The request names experiences of agents its API key may not use."""

    def __init__(self, agents: Sequence[str]):
        self.agents = sorted(agents)
        super().__init__(f"this API key may not use agent(s) {', '.join(map(repr, self.agents))}")


class AlreadyConsumed(BufferError):
    def __init__(self, ids: Sequence[str]):
        self.ids = list(ids)
        super().__init__(
            f"experience(s) already trained on or discarded, reward can no longer change: "
            f"{', '.join(self.ids)}"
        )


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


_SQLITE_BUSY_TIMEOUT_S = 60.0


def create_buffer_engine(url: str, *, create_tables: bool = True, busy_timeout_s: float = _SQLITE_BUSY_TIMEOUT_S) -> Engine:
    """An Engine on ``url`` with the settings every service needs, tables created if missing.

    Errors and logs never show statement parameters: they hold users' prompts and answers.

    ``busy_timeout_s``: SQLite only, how long a statement waits for another process's write lock.
    """
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        # A bare postgresql:// means psycopg2 to SQLAlchemy; the server extra installs psycopg 3.
        parsed = parsed.set(drivername="postgresql+psycopg")
        url = parsed.render_as_string(hide_password=False)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database
        if database and database != ":memory:" and not database.startswith("file:"):
            Path(database).expanduser().resolve().parent.mkdir(parents=True, exist_ok=True)
        # sqlite3's `timeout` is SQLite's busy timeout: how long a statement waits for another writer.
        engine = create_engine(url, connect_args={"timeout": busy_timeout_s, "check_same_thread": False},
                               hide_parameters=True)
        _configure_sqlite(engine)
    else:
        engine = create_engine(url, pool_pre_ping=True, pool_size=8, max_overflow=8, hide_parameters=True)
    if create_tables:
        _create_tables(engine)
    return engine


# Any fixed 64-bit key: serialises table creation across processes sharing a PostgreSQL database.
_SCHEMA_LOCK_KEY = 0x4B61697A656E


def _create_tables(engine: Engine) -> None:
    """Create the tables if missing, safely when several services start on one database at once.

    The check-then-create runs inside one write transaction (SQLite: ``BEGIN IMMEDIATE``;
    PostgreSQL: a transaction-scoped advisory lock), so a second process waits and then finds the
    tables instead of failing with "database is locked" or "already exists".
    """
    with write_transaction(engine) as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(select(func.pg_advisory_xact_lock(_SCHEMA_LOCK_KEY)))
        metadata.create_all(conn)
        _migrate(conn)


def _migrate(conn: Connection) -> None:
    """Bring a database made by an older Kaizen up to the tables above: add the nullable columns
    and the indexes it lacks (``create_all`` only creates missing tables). Additive only."""
    from sqlalchemy import inspect, text

    inspector = inspect(conn)
    quote = conn.dialect.identifier_preparer.quote
    for table in metadata.sorted_tables:
        have = {c["name"] for c in inspector.get_columns(table.name)}
        for column in table.columns:
            if column.name not in have:
                if not column.nullable:
                    raise RuntimeError(f"cannot add the NOT NULL column {table.name}.{column.name} to an existing table")
                log.warning("buffer: adding column %s.%s (database made by an older version)", table.name, column.name)
                kind = column.type.compile(dialect=conn.dialect)
                conn.execute(text(f"ALTER TABLE {quote(table.name)} ADD COLUMN {quote(column.name)} {kind}"))
        indexes = {i["name"] for i in inspector.get_indexes(table.name)}
        for index in table.indexes:
            if index.name not in indexes:
                index.create(conn)


def _enable_wal(cur: sqlite3.Cursor) -> None:
    """Switch the database to WAL, waiting out other processes doing the same.

    Changing the journal mode needs an exclusive lock and, unlike ordinary statements, can fail with
    "database is locked" at once instead of waiting on the busy timeout (seen when an Explorer and a
    Trainer open a fresh database together), so it is retried here.
    """
    deadline = time.monotonic() + _SQLITE_BUSY_TIMEOUT_S
    delay = 0.01
    while True:
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):  # pragma: no cover - exercised by every sqlite test
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves, below
        cur = dbapi_conn.cursor()
        _enable_wal(cur)
        cur.execute("PRAGMA synchronous=FULL")  # a 2xx promises the change survives power loss
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):
        write = conn.get_execution_options().get("kaizen_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


@contextlib.contextmanager
def write_transaction(engine: Engine) -> Iterator[Connection]:
    """A transaction that will write: committed on exit, rolled back on error."""
    with engine.connect() as conn:
        conn.execution_options(kaizen_write=True)
        with conn.begin():
            yield conn


def iter_chunks(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    """Slices of at most ``size`` items (keeps IN lists under every database's limit)."""
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _now_row(**values: Any) -> dict:
    values["updated_at"] = utcnow()
    return values


# ---------------------------------------------------------------------------------------------
# Explorer side: recording, feedback, commit, inspection.


def _buried(conn: Connection, ids: Sequence[str]) -> set[str]:
    found: set[str] = set()
    for chunk in iter_chunks(list(ids), 500):
        found.update(conn.scalars(select(tombstones.c.experience_id).where(tombstones.c.experience_id.in_(chunk))))
    return found


def insert_experiences(*, engine: Engine, records: Sequence[Experience]) -> None:
    """Insert a batch of new experiences in one transaction (never one deleted on request)."""
    if not records:
        return
    with engine.connect() as conn:
        buried = _buried(conn, [r.experience_id for r in records])
    records = [r for r in records if r.experience_id not in buried]
    if not records:
        return
    now = utcnow()
    rows = []
    for r in records:
        row = r.model_dump(mode="python")
        row["status"] = r.status.value
        row["created_at"] = r.created_at or now
        row["updated_at"] = now
        rows.append(row)
    with write_transaction(engine) as conn:
        conn.execute(insert(experiences), rows)


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
    insert_experiences(engine=engine, records=missing)
    return len(missing)


def _lock_rows(conn: Connection, experience_ids: Iterable[str]) -> dict[str, tuple[str, float | None]]:
    """Lock the rows FOR UPDATE in ascending experience_id order; {id: (status, reward)} of those
    that exist, as they are once locked (the newest committed values, even under READ COMMITTED).

    Every writer takes its row locks through here, so two transactions wanting overlapping rows
    always lock them in the same order and one waits for the other: never a deadlock.
    """
    ids = sorted(set(experience_ids))  # code point order, which PostgreSQL's "C" collation matches
    key = experiences.c.experience_id
    order = key.collate("C") if conn.dialect.name == "postgresql" else key
    seen: dict[str, tuple[str, float | None]] = {}
    for chunk in iter_chunks(ids, 500):
        q = (
            select(key, experiences.c.status, experiences.c.reward)
            .where(key.in_(chunk))
            .order_by(order)
            .with_for_update()
        )
        seen.update({e: (st, r) for e, st, r in conn.execute(q)})
    return seen


def _resolve(conn: Connection, msg_ids: Sequence[str], *, lock: bool) -> dict[str, list[tuple[str, str]]]:
    """Map each msg id (completion id or experience id) to its [(experience_id, status)].

    With ``lock``, the rows are locked (``_lock_rows``) and the statuses are the locked ones.
    """
    ids = list(dict.fromkeys(msg_ids))
    found: dict[str, list[tuple[str, str]]] = {i: [] for i in ids}
    for chunk in iter_chunks(ids, 500):
        q = select(
            experiences.c.experience_id, experiences.c.completion_id, experiences.c.status
        ).where(or_(experiences.c.experience_id.in_(chunk), experiences.c.completion_id.in_(chunk)))
        for exp_id, comp_id, status in conn.execute(q):
            if exp_id in found:
                found[exp_id].append((exp_id, status))
            if comp_id in found:
                found[comp_id].append((exp_id, status))
    if lock:
        current = _lock_rows(conn, {e for rows in found.values() for e, _ in rows})
        found = {i: [(e, current[e][0]) for e, _ in rows if e in current] for i, rows in found.items()}
    return found


def episode_experience_ids(*, engine: Engine, task_id: str, run_id: str, agent: str | None = None) -> list[str]:
    """The experience ids of every call of an episode (task_id + run_id), or of ``agent``'s calls in
    it, in arrival order."""
    e = experiences.c
    q = select(e.experience_id).where(e.task_id == task_id, e.run_id == run_id).order_by(e.seq)
    if agent is not None:
        q = q.where(e.agent == agent)
    with engine.connect() as conn:
        return list(conn.scalars(q))


def find_unknown_ids(*, engine: Engine, msg_ids: Sequence[str]) -> list[str]:
    """The msg ids that name no recorded completion or experience."""
    with engine.connect() as conn:
        found = _resolve(conn, msg_ids, lock=False)
    return [i for i, rows in found.items() if not rows]


@dataclass
class FeedbackResult:
    experience_ids: list[str]


def apply_feedback(
    *,
    engine: Engine,
    msg_ids: Sequence[str],
    reward: float,
    feedback: dict[str, Any],
    task_id: str | None = None,
    run_id: str | None = None,
    agents: Sequence[str] | None = None,
    audit: dict[str, Any] | None = None,
) -> FeedbackResult:
    """Set the reward of every experience the ids name, all or nothing.

    Raises UnknownIds if any id names nothing, AlreadyConsumed if any experience was already
    trained on (or discarded), ForbiddenAgents if ``agents`` is given and an experience belongs to
    another agent; in each case nothing changes. ``audit``: a row for ``audit_log`` (actor, action,
    target, details), written in the same transaction.
    """
    with write_transaction(engine) as conn:
        found = _resolve(conn, msg_ids, lock=True)
        unknown = [i for i, rows in found.items() if not rows]
        if unknown:
            raise UnknownIds(unknown)
        targets = sorted({e for rows in found.values() for e, _ in rows})
        _check_agents(conn, targets, agents)
        frozen = sorted({e for rows in found.values() for e, s in rows if s in TERMINAL})
        if frozen:
            raise AlreadyConsumed(frozen)
        values = _now_row(reward=float(reward), feedback=feedback)
        if task_id is not None:
            values["task_id"] = task_id
        if run_id is not None:
            values["run_id"] = run_id
        # Recorded rows become rewarded; committed rows keep their status and take the new reward.
        for chunk in iter_chunks(targets, 500):
            base = and_(experiences.c.experience_id.in_(chunk), experiences.c.status.notin_(TERMINAL))
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
        _audit(conn, audit, count=len(targets))
    return FeedbackResult(experience_ids=targets)


def _check_agents(conn: Connection, experience_ids: Sequence[str], agents: Sequence[str] | None) -> None:
    if agents is None:
        return
    found: set[str] = set()
    for chunk in iter_chunks(list(experience_ids), 500):
        found.update(conn.scalars(select(experiences.c.agent).where(experiences.c.experience_id.in_(chunk)).distinct()))
    if others := found - set(agents):
        raise ForbiddenAgents(others)


def _audit(conn: Connection, audit: dict[str, Any] | None, **details: Any) -> None:
    if audit is not None:
        conn.execute(insert(audit_log).values(
            actor=audit["actor"], action=audit["action"], target=audit.get("target"),
            details={**(audit.get("details") or {}), **details}, created_at=utcnow()))


def record_audit(*, engine: Engine, actor: str, action: str, target: Any = None, details: dict[str, Any] | None = None) -> None:
    """One row of the audit log (admin actions; feedback and commits write theirs in their own transaction)."""
    with write_transaction(engine) as conn:
        _audit(conn, {"actor": actor, "action": action, "target": target, "details": details})


def list_audit(*, engine: Engine, limit: int = 100, actor: str | None = None, action: str | None = None) -> list[dict[str, Any]]:
    """The newest ``limit`` audit rows, newest first."""
    q = select(audit_log).order_by(audit_log.c.id.desc()).limit(limit)
    if actor is not None:
        q = q.where(audit_log.c.actor == actor)
    if action is not None:
        q = q.where(audit_log.c.action == action)
    with engine.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(q)]
    for r in rows:  # SQLite hands back naive datetimes: they were written in UTC
        t = r["created_at"]
        r["created_at"] = (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).isoformat()
    return rows


def commit_experiences(
    *, engine: Engine, task_id: str | None = None, msg_ids: Sequence[str] | None = None,
    agents: Sequence[str] | None = None, audit: dict[str, Any] | None = None,
) -> int:
    """Mark rewarded experiences committed (visible to the Trainer); returns how many.

    With ``msg_ids``, only the experiences they name (unknown ids raise UnknownIds and change
    nothing); with ``task_id``, only that task's; with neither, every rewarded experience. An
    empty ``msg_ids`` names nothing and commits nothing. ``agents``: only these agents' rows
    (ids of another agent's raise ForbiddenAgents). ``audit``: as in ``apply_feedback``.
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
            found = _resolve(conn, msg_ids, lock=False)
            unknown = [i for i, rows in found.items() if not rows]
            if unknown:
                raise UnknownIds(unknown)
            targets = {e for rows in found.values() for e, _ in rows}
            _check_agents(conn, sorted(targets), agents)
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


def _row_to_experience(row: Any) -> Experience:
    data = dict(row._mapping)
    data.pop("seq", None)
    return Experience.model_validate(data)


def get_experience(*, engine: Engine, experience_id: str) -> Experience | None:
    with engine.connect() as conn:
        row = conn.execute(
            select(experiences).where(experiences.c.experience_id == experience_id)
        ).first()
    return _row_to_experience(row) if row else None


# ---------------------------------------------------------------------------------------------
# Governance: retention of raw text, and deleting a user's data.

_PURGED_TEXT = dict(prompt_token_ids=[], response_token_ids=[], response_logprobs=[], messages=[], response={},
                    tools=None)


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
        for chunk in iter_chunks(sorted(locked), 500):
            base = e.experience_id.in_(chunk)
            conn.execute(update(experiences).where(base, e.status.in_(TERMINAL))
                         .values(**_PURGED_TEXT, trainable=False, purged_at=now, updated_at=now))
            conn.execute(update(experiences).where(base, e.status.notin_(TERMINAL))
                         .values(**_PURGED_TEXT, trainable=False, purged_at=now, updated_at=now,
                                 status=ExperienceStatus.DISCARDED.value))
        return len(locked)


def delete_user_data(*, engine: Engine, user_id: str, agents: Sequence[str] | None = None,
                     audit: dict[str, Any] | None = None) -> dict[str, Any]:
    """Delete every experience of ``user_id`` (whatever its status: not-yet-trained batches included;
    a Trainer step that had read one is refused at its commit and retried without it). Returns
    what was removed, by status and agent, and which published versions were already trained on
    some of it (that cannot be taken out of an adapter; it is named so it can be retrained)."""
    e = experiences.c
    with write_transaction(engine) as conn:
        mine = [e.user_id == user_id] + ([e.agent.in_(list(agents))] if agents is not None else [])
        ids = list(conn.scalars(select(e.experience_id).where(*mine)))
        _lock_rows(conn, ids)
        # Read once locked: a Trainer step that committed meanwhile shows as consumed, with its version.
        rows = []
        for chunk in iter_chunks(ids, 500):
            rows += conn.execute(select(e.experience_id, e.status, e.agent, e.trained_in).where(e.experience_id.in_(chunk)))
        by_status: dict[str, int] = {}
        trained: dict[tuple[str, int], int] = {}
        for r in rows:
            by_status[r.status] = by_status.get(r.status, 0) + 1
            if r.status == ExperienceStatus.CONSUMED.value and r.trained_in is not None:
                trained[(r.agent, r.trained_in)] = trained.get((r.agent, r.trained_in), 0) + 1
        now = utcnow()
        for chunk in iter_chunks([r.experience_id for r in rows], 500):
            conn.execute(experiences.delete().where(e.experience_id.in_(chunk)))
            fresh = set(chunk) - _buried(conn, chunk)
            if fresh:
                conn.execute(insert(tombstones), [{"experience_id": i, "deleted_at": now} for i in sorted(fresh)])
        report = {
            "user_id": user_id, "deleted": len(rows), "by_status": by_status,
            "in_published_versions": [{"agent": a, "version": v, "experiences": n} for (a, v), n in sorted(trained.items())],
        }
        _audit(conn, audit, deleted=len(rows), by_status=by_status,
               in_published_versions=report["in_published_versions"])
        return report


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
    """How many distinct versions newer than ``newer_than`` produced experiences of ``agent``
    (by default only those carrying a task id, i.e. traffic rather than evaluation)."""
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


# ---------------------------------------------------------------------------------------------
# Trainer side: reading committed experiences, consuming them together with the step's state.


class BatchChanged(BufferError):
    """Rows of a batch changed (reward replaced, status moved) between reading and consuming."""


_TRAIN_COLUMNS = (
    experiences.c.seq,
    experiences.c.experience_id,
    experiences.c.agent,
    experiences.c.model_version,
    experiences.c.task_id,
    experiences.c.run_id,
    experiences.c.prompt_token_ids,
    experiences.c.response_token_ids,
    experiences.c.response_logprobs,
    experiences.c.sampling,
    experiences.c.reward,
    experiences.c.feedback,
    experiences.c.finish_reason,
    experiences.c.created_at,
    experiences.c.updated_at,
)


def agents_with_committed(*, engine: Engine) -> list[str]:
    q = select(experiences.c.agent).where(experiences.c.status == ExperienceStatus.COMMITTED.value).distinct()
    with engine.connect() as conn:
        return sorted(conn.scalars(q))


_DEMONSTRATION = experiences.c.completion_id.startswith(DEMONSTRATION_KIND + "-")


def fetch_committed(*, engine: Engine, agent: str, limit: int, demonstrations: bool = False) -> list[CommittedExperience]:
    """The oldest ``limit`` committed rollouts of ``agent`` (with ``demonstrations``: its
    demonstrations instead, which stay committed: the Trainer replays them)."""
    q = (
        select(*_TRAIN_COLUMNS)
        .where(experiences.c.agent == agent, experiences.c.status == ExperienceStatus.COMMITTED.value,
               _DEMONSTRATION if demonstrations else ~_DEMONSTRATION)
        .order_by(experiences.c.seq)
        .limit(limit)
    )
    with engine.connect() as conn:
        return [CommittedExperience(**r._mapping) for r in conn.execute(q)]


def team_episodes(*, engine: Engine, task_ids: Sequence[str]) -> dict[str, dict[str, TeamEpisode]]:
    """Every episode of these tasks whose last call has a reward: {task_id: {run_id: TeamEpisode}},
    the reward being its last call's (whichever agent made it). Episodes whose last call has no
    reward yet are left out: they may still be under way. Demonstrations are not episodes."""
    e = experiences.c
    last: dict[tuple[str, str], tuple[int, float | None]] = {}
    agents: dict[tuple[str, str], set[str]] = {}
    with engine.connect() as conn:
        for chunk in iter_chunks(sorted(set(task_ids)), 500):
            q = select(e.task_id, e.run_id, e.seq, e.reward, e.agent).where(
                e.task_id.in_(chunk), e.run_id.is_not(None), ~_DEMONSTRATION)
            for task, run, seq, reward, agent in conn.execute(q):
                agents.setdefault((task, run), set()).add(agent)
                if (task, run) not in last or seq > last[(task, run)][0]:
                    last[(task, run)] = (seq, reward)
    out: dict[str, dict[str, TeamEpisode]] = {}
    for (task, run), (_, reward) in last.items():
        if reward is not None:
            out.setdefault(task, {})[run] = TeamEpisode(reward=float(reward), agents=frozenset(agents[(task, run)]))
    return out


def teammate_calls(*, engine: Engine, episodes: Sequence[tuple[str, str]], agent: str) -> list[CommittedExperience]:
    """The calls other agents than ``agent`` made in these episodes ((task_id, run_id)), whatever
    their status, in arrival order: what the agent's critic values when it credits through the
    joint episode."""
    wanted = set(episodes)
    e = experiences.c
    out = []
    with engine.connect() as conn:
        for chunk in iter_chunks(sorted({t for t, _ in wanted}), 500):
            q = select(*_TRAIN_COLUMNS).where(e.task_id.in_(chunk), e.agent != agent, ~_DEMONSTRATION).order_by(e.seq)
            out += [CommittedExperience(**r._mapping) for r in conn.execute(q) if (r.task_id, r.run_id) in wanted]
    return sorted(out, key=lambda r: r.seq)


def consume_batch(
    *,
    engine: Engine,
    agent: str,
    step: int,
    version: int,
    consumed: dict[str, float | None],
    discarded: Sequence[str],
    state_ref: str | None,
    metrics: dict[str, Any] | None = None,
) -> None:
    """In one transaction: mark the batch consumed (trained_in=version), the rejected rows
    discarded, and record the step with the trainer state it produced.

    ``consumed`` maps experience id -> the reward that was trained on. If any row is no longer
    committed with that reward, raises BatchChanged and changes nothing, so the caller can roll
    its model back to the previous state and train on fresh data instead.
    """
    ids = list(consumed) + list(discarded)
    with write_transaction(engine) as conn:
        seen = _lock_rows(conn, ids)
        changed = [
            i for i in ids
            if i not in seen or seen[i][0] != ExperienceStatus.COMMITTED.value
            or (i in consumed and seen[i][1] != consumed[i])
        ]
        if changed:
            raise BatchChanged(f"{len(changed)} experience(s) changed since they were read: {', '.join(changed[:5])}")
        now = utcnow()
        for chunk in iter_chunks(list(consumed), 500):
            conn.execute(
                update(experiences)
                .where(experiences.c.experience_id.in_(chunk))
                .values(status=ExperienceStatus.CONSUMED.value, trained_in=version, updated_at=now)
            )
        for chunk in iter_chunks(list(discarded), 500):
            conn.execute(
                update(experiences)
                .where(experiences.c.experience_id.in_(chunk))
                .values(status=ExperienceStatus.DISCARDED.value, updated_at=now)
            )
        conn.execute(
            insert(trainer_steps).values(
                agent=agent, step=step, version=version, consumed=len(consumed), discarded=len(discarded),
                state_ref=state_ref, metrics=metrics, created_at=now,
            )
        )


def discard_experiences(*, engine: Engine, experience_ids: Sequence[str]) -> int:
    """Mark committed experiences discarded (never trained on); returns how many."""
    n = 0
    with write_transaction(engine) as conn:
        _lock_rows(conn, experience_ids)
        for chunk in iter_chunks(list(experience_ids), 500):
            res = conn.execute(
                update(experiences)
                .where(experiences.c.experience_id.in_(chunk), experiences.c.status == ExperienceStatus.COMMITTED.value)
                .values(status=ExperienceStatus.DISCARDED.value, updated_at=utcnow())
            )
            n += res.rowcount or 0
    return n


def last_trainer_step(*, engine: Engine, agent: str) -> TrainerStep | None:
    q = select(trainer_steps).where(trainer_steps.c.agent == agent).order_by(trainer_steps.c.id.desc()).limit(1)
    with engine.connect() as conn:
        row = conn.execute(q).first()
    return TrainerStep(**row._mapping) if row else None


def recent_trainer_steps(*, engine: Engine, agents: Sequence[str], limit: int) -> list[tuple[str, datetime]]:
    """(agent, created_at) of the newest ``limit`` trainer steps of ``agents``, newest first."""
    t = trainer_steps.c
    q = select(t.agent, t.created_at).where(t.agent.in_(list(agents))).order_by(t.id.desc()).limit(limit)
    with engine.connect() as conn:
        return [(r.agent, r.created_at) for r in conn.execute(q)]


def publishing_steps(*, engine: Engine, agent: str, save_interval: int) -> dict[int, str]:
    """{version: state_ref} of the steps that closed a version (every ``save_interval``-th step): the
    trainer state each published version was written from."""
    t = trainer_steps.c
    q = select(t.version, t.step, t.state_ref).where(t.agent == agent, t.state_ref.is_not(None)).order_by(t.id)
    with engine.connect() as conn:
        return {v: ref for v, step, ref in conn.execute(q) if step % save_interval == 0}


def consumed_ids(*, engine: Engine, agent: str | None = None, trained_in: int | None = None) -> list[tuple[str, int]]:
    """(experience_id, trained_in) of the consumed experiences, of one agent and one version when
    given (a version's lineage: an index lookup, whatever the size of the agent's history)."""
    q = select(experiences.c.experience_id, experiences.c.trained_in).where(
        experiences.c.status == ExperienceStatus.CONSUMED.value
    )
    if agent is not None:
        q = q.where(experiences.c.agent == agent)
    if trained_in is not None:
        q = q.where(experiences.c.trained_in == trained_in)
    with engine.connect() as conn:
        return [(e, v) for e, v in conn.execute(q)]


# ---------------------------------------------------------------------------------------------
# Releases: decisions about which version serves, and the online rewards they rest on.

def record_decision(
    *, engine: Engine, agent: str, version: int, decision: str, serving: int | None, actor: str,
    reason: str | None = None, figures: dict[str, Any] | None = None,
) -> ReleaseDecision:
    """Record a release decision (who decided what about which version, with the figures)."""
    now = utcnow()
    with write_transaction(engine) as conn:
        row_id = conn.execute(insert(release_decisions).values(
            agent=agent, version=version, decision=decision, serving=serving, actor=actor,
            reason=None if reason is None else reason[:2000], figures=figures, created_at=now,
        )).inserted_primary_key[0]
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
                                   or_(e.task_id.is_(None), ~e.task_id.startswith(_EVAL_TASK_PREFIX)))
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
                or_(e.task_id.is_(None), ~e.task_id.startswith(_EVAL_TASK_PREFIX)))
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
