"""Opening the buffer and writing to it safely: the engine, table creation and migrations, SQLite's
set-up, write transactions and the row locks every writer takes.

Nothing here assumes SQLite: row locks use ``FOR UPDATE`` (ignored by SQLite, which serialises
writers anyway), and SQLite write transactions start with ``BEGIN IMMEDIATE`` so two writers never
deadlock upgrading a read lock. On PostgreSQL every writer locks the rows it changes before changing
them, always in ascending experience_id order (``_lock_rows``), so concurrent writers (Explorer
replicas, the Trainer) queue instead of deadlocking.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import sqlite3
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from sqlalchemy import create_engine, delete, event, func, insert, inspect, or_, select, text
from sqlalchemy.engine import Connection, Engine, make_url

from services.common.buffer.schema import experiences, metadata, write_probes

log = logging.getLogger("services.common.buffer")


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
    """Bring a database made by an older Kaizen up to the tables of ``schema``: add the nullable columns
    and the indexes it lacks (``create_all`` only creates missing tables). Additive only."""

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
def write_transaction(engine: Engine, *, durable: bool = True) -> Iterator[Connection]:
    """A transaction that will write: committed on exit, rolled back on error. ``durable=False``
    (PostgreSQL): committed without waiting for the WAL to reach the disk, for bookkeeping whose last
    few changes a crash may lose (quotas, episode pins), never the database's consistency."""
    with engine.connect() as conn:
        conn.execution_options(kaizen_write=True)
        with conn.begin():
            if not durable and conn.dialect.name == "postgresql":
                conn.execute(text("SET LOCAL synchronous_commit TO OFF"))
            yield conn


def probe_write(*, engine: Engine, writer: str) -> None:
    """One small write transaction (``writer``'s row of ``write_probes`` rewritten, rows of writers
    gone a day dropped): raises what the database raises when it takes no writes at all."""
    now = utcnow()
    with write_transaction(engine) as conn:
        conn.execute(delete(write_probes).where(or_(write_probes.c.writer == writer,
                                                    write_probes.c.at < now - timedelta(days=1))))
        conn.execute(insert(write_probes).values(writer=writer, at=now))


def iter_chunks(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    """Slices of at most ``size`` items (keeps IN lists under every database's limit)."""
    for i in range(0, len(items), size):
        yield items[i : i + size]


_USER_LOCK_SPACE = 0x4B5A0001  # "KZ", 1: a user's rows (_lock_users)


def user_hash(user_id: str) -> str:
    """How ``deleted_users`` names a user: the SHA-256 of the id, so the deletion keeps no id in the clear."""
    return hashlib.sha256(user_id.encode()).hexdigest()


def _lock_users(conn: Connection, user_ids: Iterable[str]) -> None:
    """Serialise, per user, writing a user's new rows with deleting that user's data: on PostgreSQL a
    transaction-scoped advisory lock per user, taken in one order (SQLite's writers are serialised
    by BEGIN IMMEDIATE already). Taken before any row lock."""
    if conn.dialect.name != "postgresql":
        return
    # the two-key form (a space of its own, apart from the schema lock's single key): users, hash of the id
    keys = sorted({int.from_bytes(hashlib.sha256(u.encode()).digest()[:4], "big", signed=True) for u in user_ids})
    for key in keys:
        conn.execute(text("SELECT pg_advisory_xact_lock(:space, :key)"), {"space": _USER_LOCK_SPACE, "key": key})


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
