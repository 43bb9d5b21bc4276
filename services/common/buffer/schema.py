"""The buffer's tables and indexes, the predicates several queries share, and the errors its calls raise.

Changing a table here is a change of the on-disk contract: a new column must be nullable, and
``engine._migrate`` adds it to databases made by an older Kaizen.
"""

from __future__ import annotations

from typing import Any, Sequence

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
)

from services.common.records import DEMONSTRATION_KIND, Experience, ExperienceStatus

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
    # Feedback in words: {"text", "prompt_token_ids" (the teacher's prompt: this call's conversation with
    # the hint as a note, rendered by the served chat template), "source", "at"}; kept apart from
    # ``feedback`` so a later reward never drops it.
    Column("hint", JSON),
)

# Retention's scan (purge_text): rows older than a date whose text is still there.
Index("ix_experiences_created_purged", experiences.c.created_at, experiences.c.purged_at)
# The Trainer's poll: committed rows of one agent in arrival order.
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
# The dashboard's aggregates per agent (over time, per version; a rollup cell: one agent, version and
# minute) read this index alone, never the rows.
Index("ix_experiences_dashboard", experiences.c.agent, experiences.c.model_version, experiences.c.created_at,
      experiences.c.status, experiences.c.reward)
# What changed since a time (every write stamps updated_at): the dashboard's rollups read which
# cells (agent, version, minute of created_at) to compute again from this index alone.
Index("ix_experiences_changes", experiences.c.updated_at, experiences.c.agent, experiences.c.model_version,
      experiences.c.created_at)

# Every reward ever sent, in arrival order (the experience's ``reward`` is the latest): a reward sent
# after its experience was trained on (late) is recorded here, never refused.
reward_ledger = Table(
    "reward_ledger",
    metadata,
    Column("id", _ID, primary_key=True, autoincrement=True),
    Column("experience_id", String(96), nullable=False),
    Column("agent", String(128), nullable=False),
    Column("reward", Float, nullable=False),
    Column("source", String(128)),  # the feedback's source (api, runner_sdk, ...)
    Column("actor", String(128)),  # the API key's name that sent it
    Column("late", Boolean, nullable=False),  # sent after the experience was trained on (or discarded)
    Column("status_at", String(16), nullable=False),  # the experience's status when it came
    Column("trained_in", Integer),  # a late one: the version that had trained on the experience
    Column("outcome", String(256)),  # applied (before training); a late one: recorded, then what a step did
    Column("created_at", DateTime(timezone=True), nullable=False),
)
LATE_PENDING = "recorded"  # a late reward's outcome until a Trainer step handles it (late_rewards: retrain)
Index("ix_reward_ledger_experience", reward_ledger.c.experience_id, reward_ledger.c.id)
Index("ix_reward_ledger_agent_late", reward_ledger.c.agent, reward_ledger.c.late, reward_ledger.c.id)

# Feedback sent with an idempotency key: what it did, so a retry of it (a client that timed out
# after the Explorer applied it) changes nothing and gets the same answer. Keys are per API key
# (``actor``) and kept ``recorder.feedback_key_ttl_s`` (pruned as new keys arrive).
feedback_keys = Table(
    "feedback_keys",
    metadata,
    Column("actor", String(128), primary_key=True),
    Column("key", String(128), primary_key=True),
    Column("request_hash", String(64), nullable=False),  # the body's digest: the same key with another body is refused
    Column("result", JSON, nullable=False),  # the FeedbackResult it gave
    Column("created_at", DateTime(timezone=True), nullable=False, index=True),
)

# One row per recorder process, rewritten by its probe: does the database take writes at all? (An
# error that says "unavailable" while the probe goes through is the data's fault, not the database's.)
write_probes = Table(
    "write_probes",
    metadata,
    Column("writer", String(128), primary_key=True),
    Column("at", DateTime(timezone=True), nullable=False, index=True),
)

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
    # Added after the first release (null in older rows): where the row was, so the dashboard's
    # rollups know which minute of which agent and version to compute again.
    Column("agent", String(128)),
    Column("model_version", Integer),
    Column("created_at", DateTime(timezone=True)),
)
Index("ix_tombstones_deleted_at", tombstones.c.deleted_at)

# Users whose data was deleted on request: a record of theirs created before the deletion that some
# replica writes later (still queued in its recorder, or replayed from a journal) is dropped, not written.
deleted_users = Table(
    "deleted_users",
    metadata,
    Column("id", _ID, primary_key=True, autoincrement=True),
    Column("user_sha256", String(64), nullable=False, index=True),  # engine.user_hash: no id kept in the clear
    Column("agent", String(128)),  # the agent whose rows went (null: every agent)
    Column("deleted_at", DateTime(timezone=True), nullable=False),
)

# API keys' quotas, shared by every replica on this database (services/common/buffer/quotas.py): one token
# bucket per key and kind ("requests", "tokens"), refilled by wall-clock time, and the tokens that running
# requests hold until they end (a hold of a replica that died expires at ``expires_at``).
quota_buckets = Table(
    "quota_buckets",
    metadata,
    Column("name", String(128), primary_key=True),
    Column("kind", String(16), primary_key=True),
    Column("level", Float, nullable=False),
    Column("stamp", Float, nullable=False),  # seconds since the epoch of the level's last update
)
quota_holds = Table(
    "quota_holds",
    metadata,
    Column("hold_id", String(96), primary_key=True),
    Column("name", String(128), nullable=False, index=True),
    Column("tokens", Float, nullable=False),
    Column("expires_at", Float, nullable=False),
)

# Multi-call episodes' versions, shared by every Explorer replica on this database (services/common/buffer/
# pins.py): the version an episode's first call used, so that its later calls get it whichever replica
# serves them. A row older than reload.episode_pin_s no longer pins.
episode_pins = Table(
    "episode_pins",
    metadata,
    Column("agent", String(128), primary_key=True),
    Column("task_id", String(256), primary_key=True),
    Column("run_id", String(128), primary_key=True),
    Column("version", Integer, nullable=False),
    Column("first_at", Float, nullable=False, index=True),  # seconds since the epoch of the first call
)

TERMINAL = (ExperienceStatus.CONSUMED.value, ExperienceStatus.DISCARDED.value)

# Demonstrations (records posted to /demonstrations) stay committed: the Trainer replays them.
_DEMONSTRATION = experiences.c.completion_id.startswith(DEMONSTRATION_KIND + "-")


def _row_to_experience(row: Any) -> Experience:
    data = dict(row._mapping)
    data.pop("seq", None)
    return Experience.model_validate(data)


class BufferError(Exception):
    """Base of the errors a buffer call reports to its caller."""


class UnknownIds(BufferError):
    def __init__(self, ids: Sequence[str]):
        self.ids = list(ids)
        super().__init__(f"unknown id(s): {', '.join(self.ids)}")


class AlreadyConsumed(BufferError):
    """Words for experiences already trained on (or discarded): a hint teaches only what is still to
    be trained. (A reward is never refused so: it is recorded late, see ``reward_ledger``.)"""

    def __init__(self, ids: Sequence[str]):
        self.ids = list(ids)
        super().__init__(
            f"experience(s) already trained on or discarded, a hint can no longer teach them: "
            f"{', '.join(self.ids)}"
        )


class IdempotencyKeyReused(BufferError):
    """An idempotency key already used by this API key for a feedback with another body."""

    def __init__(self, key: str):
        self.key = key
        super().__init__(f"idempotency key {key!r} was already used for a different feedback body; "
                         "a retry must resend the same body (or use a new key)")


class BatchChanged(BufferError):
    """Rows of a batch changed (reward replaced, status moved) between reading and consuming."""
