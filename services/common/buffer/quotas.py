"""API keys' quotas kept in the database, so that every Explorer replica (and the dashboard) on it
counts against one bucket per key: requests and tokens a minute, token buckets refilled by wall-clock
time. Each call is one short write transaction that locks the key's bucket row (PostgreSQL: FOR UPDATE;
SQLite: BEGIN IMMEDIATE), so concurrent admissions on several replicas are serialised and none is lost.
On PostgreSQL they commit without waiting for the WAL's fsync (``durable=False``): a crash can lose
the last few counts (a key gets a little more), and an admission does not wait for a disk.

Running model requests hold the tokens they may use (``reserve``) until they end (``settle``); a hold
whose replica died before settling expires at its ``expires_at`` and stops counting.
"""

from __future__ import annotations

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

from services.common.buffer.engine import write_transaction
from services.common.buffer.schema import quota_buckets, quota_holds

REQUESTS, TOKENS = "requests", "tokens"


def _level(conn: Connection, name: str, kind: str, per_min: float, now: float) -> tuple[float, float]:
    """(the bucket's level refilled to ``now``, the time to stamp it with), its row created full if
    missing and locked. The stamp never moves back: replicas' clocks differ a little, and a stamp set
    back by a lagging clock would let the next replica count the difference as refill time (each pair
    of calls gaining the skew's worth). So a lagging replica refills nothing until its clock passes
    the stamp, and the skew can only under-admit."""
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite if conn.dialect.name == "sqlite" else None
    if dialect is not None:
        conn.execute(dialect.insert(quota_buckets).values(name=name, kind=kind, level=per_min, stamp=now)
                     .on_conflict_do_nothing(index_elements=["name", "kind"]))
    b = quota_buckets.c
    row = conn.execute(select(b.level, b.stamp).where(b.name == name, b.kind == kind).with_for_update()).first()
    if row is None:  # another database: no portable insert-if-missing, and this transaction holds the write
        conn.execute(insert(quota_buckets).values(name=name, kind=kind, level=per_min, stamp=now))
        return float(per_min), now
    return min(float(per_min), row.level + max(0.0, now - row.stamp) * per_min / 60.0), max(now, row.stamp)


def _store(conn: Connection, name: str, kind: str, level: float, stamp: float) -> None:
    b = quota_buckets.c
    conn.execute(update(quota_buckets).where(b.name == name, b.kind == kind).values(level=level, stamp=stamp))


def _wait_s(need: float, level: float, per_min: float) -> float:
    return max(0.0, (need - level) * 60.0 / per_min)


def admit(*, engine: Engine, name: str, requests_per_min: int | None, tokens_per_min: int | None, now: float) -> float | None:
    """A request of key ``name``: None when admitted (its request counted), else the seconds to wait.
    Refused while the key's token bucket is empty or its request bucket holds less than one."""
    with write_transaction(engine, durable=False) as conn:
        if tokens_per_min is not None:
            level, _ = _level(conn, name, TOKENS, tokens_per_min, now)
            if level <= 0:
                return _wait_s(1.0, level, tokens_per_min)
        if requests_per_min is not None:
            level, stamp = _level(conn, name, REQUESTS, requests_per_min, now)
            if level < 1:
                return _wait_s(1.0, level, requests_per_min)
            _store(conn, name, REQUESTS, level - 1, stamp)
    return None


def reserve(*, engine: Engine, name: str, per_min: int, tokens: int, hold_id: str, hold_s: float, now: float) -> float | None:
    """Hold ``tokens`` of key ``name``'s token quota for a running request (``hold_id``): None when
    held, else the seconds until the bucket, less what live holds keep, could cover them (the whole
    quota, for a request larger than it). Expired holds are dropped on the way."""
    h = quota_holds.c
    with write_transaction(engine, durable=False) as conn:
        level, stamp = _level(conn, name, TOKENS, per_min, now)
        conn.execute(delete(quota_holds).where(h.name == name, h.expires_at <= now))
        held = float(conn.execute(select(func.coalesce(func.sum(h.tokens), 0.0)).where(h.name == name)).scalar())
        need = min(float(tokens), float(per_min))
        if level - held < need:
            return _wait_s(need + held, level, per_min)
        conn.execute(insert(quota_holds).values(hold_id=hold_id, name=name, tokens=float(tokens), expires_at=now + hold_s))
        _store(conn, name, TOKENS, level, stamp)
    return None


def settle(*, engine: Engine, name: str, per_min: int, hold_id: str, used: int, now: float) -> None:
    """The request that held ``hold_id`` ended having used ``used`` tokens: its hold goes, what it
    used is charged (even when the hold had expired: the caller settles each request once)."""
    with write_transaction(engine, durable=False) as conn:
        level, stamp = _level(conn, name, TOKENS, per_min, now)
        conn.execute(delete(quota_holds).where(quota_holds.c.hold_id == hold_id))
        _store(conn, name, TOKENS, level - used, stamp)


def reset(*, engine: Engine, name: str | None = None) -> None:
    """Forget the buckets and holds of key ``name`` (every key: None): they start full again."""
    with write_transaction(engine, durable=False) as conn:
        conn.execute(delete(quota_buckets).where(quota_buckets.c.name == name) if name else delete(quota_buckets))
        conn.execute(delete(quota_holds).where(quota_holds.c.name == name) if name else delete(quota_holds))
