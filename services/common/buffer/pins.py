"""Episode pins kept in the database, so that every Explorer replica on it serves a multi-call
episode (task_id + run_id) with the version its first call used, whichever replica served that call.
The first replica to record an episode's version wins (an insert that does nothing when the row is
there); a pin older than its time to live no longer counts and is replaced by the next call's. The
writes commit without waiting for PostgreSQL's WAL fsync (``durable=False``): a crash can lose the
last pins, and those episodes then go on with the current version."""

from __future__ import annotations

import random

from sqlalchemy import delete, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine

from services.common.buffer.engine import write_transaction
from services.common.buffer.schema import episode_pins

_P = episode_pins.c
SWEEP_SHARE = 0.01  # of claims that also drop every lapsed pin (else each claim drops its own key's only)


def _key(agent: str, task_id: str, run_id: str):
    return (_P.agent == agent) & (_P.task_id == task_id) & (_P.run_id == run_id)


def find(*, engine: Engine, agent: str, task_id: str, run_id: str, now: float, ttl_s: float) -> tuple[int, float] | None:
    """(the version the episode is pinned to, its first call's time), or None (never pinned, or the
    pin is older than ``ttl_s``)."""
    with engine.connect() as conn:
        row = conn.execute(select(_P.version, _P.first_at).where(_key(agent, task_id, run_id),
                                                                 _P.first_at > now - ttl_s)).first()
    return None if row is None else (int(row.version), float(row.first_at))


def claim(*, engine: Engine, agent: str, task_id: str, run_id: str, version: int, now: float,
          ttl_s: float) -> tuple[int, float]:
    """Pin the episode to ``version`` unless another call pinned it first (and its pin still
    counts): (the version it is pinned to either way, its first call's time)."""
    values = dict(agent=agent, task_id=task_id, run_id=run_id, version=version, first_at=now)
    with write_transaction(engine, durable=False) as conn:
        lapsed = _P.first_at <= now - ttl_s
        conn.execute(delete(episode_pins).where(lapsed if random.random() < SWEEP_SHARE
                                                else _key(agent, task_id, run_id) & lapsed))
        name = conn.dialect.name
        if name in ("postgresql", "sqlite"):
            dialect = postgresql if name == "postgresql" else sqlite
            conn.execute(dialect.insert(episode_pins).values(**values).on_conflict_do_nothing())
        elif conn.execute(select(_P.version).where(_key(agent, task_id, run_id))).first() is None:
            conn.execute(insert(episode_pins).values(**values))
        row = conn.execute(select(_P.version, _P.first_at).where(_key(agent, task_id, run_id))).first()
    return (version, now) if row is None else (int(row.version), float(row.first_at))


def move(*, engine: Engine, agent: str, task_id: str, run_id: str, version: int, now: float) -> None:
    """The episode's pinned version is gone (deleted): it goes on with ``version``, pinned anew."""
    values = dict(agent=agent, task_id=task_id, run_id=run_id, version=version, first_at=now)
    with write_transaction(engine, durable=False) as conn:
        name = conn.dialect.name
        if name in ("postgresql", "sqlite"):
            dialect = postgresql if name == "postgresql" else sqlite
            conn.execute(dialect.insert(episode_pins).values(**values).on_conflict_do_update(
                index_elements=["agent", "task_id", "run_id"], set_={"version": version, "first_at": now}))
        elif not conn.execute(update(episode_pins).where(_key(agent, task_id, run_id))
                              .values(version=version, first_at=now)).rowcount:
            conn.execute(insert(episode_pins).values(**values))


def forget_version(*, engine: Engine, agent: str, version: int) -> int:
    """Drop every pin to ``agent``'s ``version`` (it was rejected or rolled back); how many."""
    with write_transaction(engine) as conn:
        return conn.execute(delete(episode_pins).where(_P.agent == agent, _P.version == version)).rowcount
