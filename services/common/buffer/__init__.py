"""The SQL experience buffer: its tables and every query the services run against them.

SQLAlchemy Core over any SQL database (SQLite with WAL by default, PostgreSQL in production).
Functions take keyword arguments and either an Engine (they open their own transaction) or a
Connection already inside one. Callers use the package (``buffer.apply_feedback(...)``); the
modules are its rooms:

    schema      the tables and indexes, shared predicates, the errors calls raise
    engine      the engine, table creation and migrations, SQLite set-up, write transactions, row locks
    recording   the Explorer's writes: recording, feedback, commits
    governance  the audit log, retention of raw text, deleting a user's data
    reports     single experiences, lists and counts for the APIs, the dashboard and back-pressure
    training    the Trainer's reads, consuming a batch with its step, steps and lineage
    releases    release decisions and the online rewards they rest on
    quotas      API keys' request and token buckets, shared by every replica on the database
    pins        multi-call episodes' versions, shared by every replica on the database
"""

from sqlalchemy import select  # callers build ad-hoc queries on the tables as buffer.select(...)

from services.common.buffer.engine import create_buffer_engine, iter_chunks, probe_write, utcnow, write_transaction
from services.common.buffer.governance import delete_user_data, list_audit, purge_text
from services.common.buffer import pins, quotas
from services.common.buffer.recording import (
    FeedbackResult,
    IdempotencyKey,
    apply_feedback,
    commit_experiences,
    episode_experience_ids,
    feedback_rows,
    replayed_feedback,
    reward_histories,
    reward_history,
    find_unknown_ids,
    insert_experiences,
    insert_missing_experiences,
)
from services.common.buffer.releases import (
    list_decisions,
    newest_decided_version,
    recent_rewarded,
    record_decision,
    version_rewards,
)
from services.common.buffer.reports import (
    RewardPoint,
    committed_backlog,
    count_by_status,
    count_versions_served,
    get_experience,
    list_experiences,
    rewarded_history,
)
from services.common.buffer.schema import (
    LATE_PENDING,
    TERMINAL,
    AlreadyConsumed,
    BatchChanged,
    BufferError,
    IdempotencyKeyReused,
    UnknownIds,
    audit_log,
    experiences,
    feedback_keys,
    metadata,
    release_decisions,
    reward_ledger,
    tombstones,
    deleted_users,
    trainer_steps,
)
from services.common.buffer.training import (
    agents_with_committed,
    consume_batch,
    consumed_ids,
    discard_experiences,
    fetch_committed,
    fetch_experiences,
    fetch_successes,
    last_trainer_step,
    pending_late_rewards,
    publishing_steps,
    recent_trainer_steps,
    retrained_in,
    team_episodes,
    teammate_calls,
)

__all__ = [
    # schema
    "metadata", "experiences", "trainer_steps", "release_decisions", "reward_ledger", "feedback_keys", "audit_log", "tombstones", "deleted_users", "TERMINAL",
    "LATE_PENDING", "BufferError", "UnknownIds", "AlreadyConsumed", "IdempotencyKeyReused", "BatchChanged",
    # engine
    "create_buffer_engine", "write_transaction", "iter_chunks", "utcnow",
    # recording
    "insert_experiences", "insert_missing_experiences", "probe_write", "find_unknown_ids", "episode_experience_ids",
    "FeedbackResult", "IdempotencyKey", "apply_feedback", "feedback_rows", "replayed_feedback", "reward_histories", "reward_history", "commit_experiences",
    # governance
    "list_audit", "purge_text", "delete_user_data",
    # quotas (the module: buffer.quotas.admit, .reserve, .settle, .reset)
    "quotas",
    # pins (the module: buffer.pins.find, .claim, .move, .forget_version)
    "pins",
    # reports
    "get_experience", "list_experiences", "RewardPoint", "rewarded_history", "count_versions_served",
    "count_by_status", "committed_backlog",
    # training
    "agents_with_committed", "fetch_committed", "fetch_experiences", "fetch_successes", "team_episodes", "teammate_calls",
    "consume_batch", "pending_late_rewards", "retrained_in",
    "discard_experiences", "last_trainer_step", "recent_trainer_steps", "publishing_steps", "consumed_ids",
    # releases
    "record_decision", "list_decisions", "newest_decided_version", "recent_rewarded", "version_rewards",
]
