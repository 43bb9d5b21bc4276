"""The Trainer's side: reading committed experiences (and the episodes they belong to), consuming them
together with the step's state in one transaction, and the steps and lineage it leaves behind."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Sequence

from sqlalchemy import insert, or_, select, update
from sqlalchemy.engine import Engine

from services.common.buffer.engine import _lock_rows, iter_chunks, utcnow, write_transaction
from services.common.buffer.schema import (
    _DEMONSTRATION,
    LATE_PENDING,
    BatchChanged,
    experiences,
    reward_ledger,
    trainer_steps,
)
from services.common.records import EVAL_TASK_PREFIX, CommittedExperience, ExperienceStatus, TeamEpisode, TrainerStep

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
    experiences.c.hint,
)


def agents_with_committed(*, engine: Engine) -> list[str]:
    q = select(experiences.c.agent).where(experiences.c.status == ExperienceStatus.COMMITTED.value).distinct()
    with engine.connect() as conn:
        return sorted(conn.scalars(q))


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


def fetch_successes(*, engine: Engine, agent: str, min_reward: float, limit: int) -> list[CommittedExperience]:
    """The newest ``limit`` rollouts of ``agent`` already trained on (consumed) whose reward is at
    least ``min_reward``, oldest first: the agent's own successes, which the Trainer replays beside
    its demonstrations (``algorithm.self_imitation``). Evaluation calls and purged rows never count."""
    e = experiences.c
    q = (
        select(*_TRAIN_COLUMNS)
        .where(e.agent == agent, e.status == ExperienceStatus.CONSUMED.value, e.reward >= min_reward, ~_DEMONSTRATION,
               e.purged_at.is_(None), or_(e.task_id.is_(None), ~e.task_id.startswith(EVAL_TASK_PREFIX)))
        .order_by(e.seq.desc())
        .limit(limit)
    )
    with engine.connect() as conn:
        return [CommittedExperience(**r._mapping) for r in conn.execute(q)][::-1]


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


def _by_value(d: dict[int, str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for k, v in d.items():
        out.setdefault(v, []).append(k)
    return out


def pending_late_rewards(*, engine: Engine, agent: str, limit: int) -> list[tuple[int, str]]:
    """(ledger id, experience id) of ``agent``'s late rewards no step has handled yet, oldest first."""
    r = reward_ledger.c
    q = select(r.id, r.experience_id).where(r.agent == agent, r.late.is_(True), r.outcome == LATE_PENDING) \
        .order_by(r.id).limit(limit)
    with engine.connect() as conn:
        return [(int(i), e) for i, e in conn.execute(q)]


def fetch_experiences(*, engine: Engine, experience_ids: Sequence[str]) -> list[CommittedExperience]:
    """What the Trainer reads of these experiences (a late reward's), in arrival order: those consumed,
    their text kept and trainable (a purged or withdrawn one is never trained again)."""
    rows = []
    with engine.connect() as conn:
        for chunk in iter_chunks(sorted(set(experience_ids)), 500):
            rows += conn.execute(select(*_TRAIN_COLUMNS, experiences.c.status, experiences.c.purged_at,
                                        experiences.c.trainable).where(experiences.c.experience_id.in_(chunk)))
    return [CommittedExperience(**{k: v for k, v in r._mapping.items() if k not in ("status", "purged_at", "trainable")})
            for r in sorted(rows, key=lambda r: r.seq)
            if r.status == ExperienceStatus.CONSUMED.value and r.purged_at is None and r.trainable is not False]


def retrained_in(*, engine: Engine, agent: str, version: int) -> list[str]:
    """The experiences whose late reward was retrained in ``version`` (its lineage, beside consumed_ids)."""
    r = reward_ledger.c
    q = select(r.experience_id).where(r.agent == agent, r.outcome == f"retrained in v{version}").distinct()
    with engine.connect() as conn:
        return sorted(conn.scalars(q))


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
    late_outcomes: dict[int, str] | None = None,
    unhinted: Sequence[str] = (),
) -> None:
    """In one transaction: mark the batch consumed (trained_in=version), the rejected rows
    discarded, and record the step with the trainer state it produced.

    ``consumed`` maps experience id -> the reward that was trained on. If any row is no longer
    committed with that reward, raises BatchChanged and changes nothing, so the caller can roll
    its model back to the previous state and train on fresh data instead.

    ``late_outcomes``: {reward_ledger id: what this step did with that late reward} (retrained in
    this version, or why not), set on ledger rows still pending only, in the same transaction: a step
    redone after a crash finds them pending again, and none is ever handled twice.

    ``unhinted``: of ``consumed``, those trained without a hint by an objective that learns from
    hints; one that got a hint meanwhile raises BatchChanged too (the step is redone with it).
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
        # read back, not tested in SQL: a row written without a hint may hold JSON null
        hinted = [i for chunk in iter_chunks(sorted(unhinted), 500) for i, hint in conn.execute(
            select(experiences.c.experience_id, experiences.c.hint).where(experiences.c.experience_id.in_(chunk)))
            if hint and hint.get("prompt_token_ids")]  # a hint as the Trainer reads it (batches.to_item)
        if hinted:
            raise BatchChanged(f"a hint arrived for {len(hinted)} experience(s) while this step trained them without it: "
                               f"{', '.join(hinted[:5])}")
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
        for outcome, ledger_ids in _by_value(late_outcomes or {}).items():
            for chunk in iter_chunks(ledger_ids, 500):
                conn.execute(update(reward_ledger).where(reward_ledger.c.id.in_(chunk),
                                                         reward_ledger.c.outcome == LATE_PENDING).values(outcome=outcome))
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
