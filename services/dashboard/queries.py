"""What the dashboard shows, read from the buffer and the checkpoint root.

Every figure over experiences is an aggregate computed by the database (counts, sums and sums of
squares per time bucket, version or status), read through indexes that hold the columns it needs
(``ix_experiences_dashboard``: agent, model_version, created_at, status, reward), so a page costs
at most one index range scan per agent; once the dashboard's per-minute rollups are ready
(services/dashboard/rollups.py) the overview and the versions' traffic are summed from them instead.
Lists are paged by ``seq`` (keyset, not OFFSET). Nothing here writes.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from datetime import timezone
from pathlib import Path
from typing import Any, Sequence

from sqlalchemy import BigInteger, Integer, and_, cast, extract, func, select
from sqlalchemy.engine import Engine

from services.common import buffer, checkpoints
from services.common.buffer import experiences, release_decisions, trainer_steps
from services.common.records import ExperienceStatus

STATUSES = [s.value for s in ExperienceStatus]
Z95 = 1.959964  # two-sided 95% normal quantile: the confidence bands
# Bucket widths (seconds) the reward-over-time chart picks from: about MAX_BUCKETS points at most.
_WIDTHS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800,
           604800)
MAX_BUCKETS = 120
# The figures every Trainer step records; each objective adds its own, listed in the step's
# ``objective_figures`` and passed through unnamed.
TRAINER_FIGURES = ("reward_mean", "reward_std", "loss", "kl", "entropy", "logprob_mismatch",
                   "staleness_mean", "tokens_per_s", "step_seconds", "grad_norm", "batch_size", "demo_nll")


def _bucket(engine: Engine, column, width: int):
    """The ``width``-second bucket of a timestamp column (whole seconds since 1970 // width), in the
    database's own dialect: exact, where julianday's float arithmetic would put 12:00:10 at 12:00:09.99995."""
    if engine.dialect.name == "sqlite":
        return cast(func.strftime("%s", column), Integer).op("/")(width)  # INTEGER / INTEGER: floor division
    return cast(func.floor(extract("epoch", column) / width), BigInteger)


def _timestamp(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if value.tzinfo is None:  # SQLite keeps no zone: every service writes UTC
        value = value.replace(tzinfo=timezone.utc)
    return value.timestamp()


def mean_band(n: int, total: float | None, squares: float | None) -> dict[str, float | None]:
    """Mean of ``n`` values from their sum and sum of squares, with a 95% normal confidence band
    (None for a band of fewer than two values)."""
    if n <= 0 or total is None:
        return {"mean": None, "low": None, "high": None, "n": n}
    mean = total / n
    if n < 2 or squares is None:
        return {"mean": mean, "low": None, "high": None, "n": n}
    var = max(0.0, (squares - n * mean * mean) / (n - 1))
    half = Z95 * math.sqrt(var / n)
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n}


def bucket_width(span_s: float) -> int:
    for w in _WIDTHS:
        if span_s / w <= MAX_BUCKETS:
            return w
    return int(math.ceil(span_s / MAX_BUCKETS / 3600)) * 3600  # whole hours, as the rollups sum them


def _distinct_agents(conn, column) -> set[str]:
    """The distinct values of an indexed agent column, one index seek each (a loose index scan:
    neither SQLite nor PostgreSQL before 18 skips through an index for SELECT DISTINCT)."""
    found: set[str] = set()
    current = conn.execute(select(func.min(column))).scalar()
    while current is not None:
        found.add(current)
        current = conn.execute(select(func.min(column)).where(column > current)).scalar()
    return found


def agents(engine: Engine, root: str | Path) -> list[str]:
    """Every agent with experiences, Trainer steps or published versions."""
    with engine.connect() as conn:
        names = _distinct_agents(conn, experiences.c.agent) | _distinct_agents(conn, trainer_steps.c.agent)
    names |= set(checkpoints.list_agents(root))
    return sorted(names)


def agent_exists(engine: Engine, root: str | Path, agent: str) -> bool:
    e, t = experiences.c, trainer_steps.c
    with engine.connect() as conn:
        if conn.execute(select(e.seq).where(e.agent == agent).limit(1)).first() is not None:
            return True
        if conn.execute(select(t.id).where(t.agent == agent).limit(1)).first() is not None:
            return True
    return agent in checkpoints.list_agents(root)


def serving(root: str | Path, agent: str) -> dict[str, int | None]:
    """The versions LATEST and CANDIDATE name (LATEST serves; a candidate waits for its release decision)."""
    try:
        latest = checkpoints.read_latest(root, agent)
    except checkpoints.CheckpointError:
        latest = None
    try:
        candidate = checkpoints.read_candidate(root, agent)
    except checkpoints.CheckpointError:
        candidate = None
    return {"serving": latest, "candidate": candidate}


def status_counts(engine: Engine, agent: str) -> dict[str, int]:
    e = experiences.c
    with engine.connect() as conn:
        found = dict(conn.execute(select(e.status, func.count()).where(e.agent == agent).group_by(e.status)).all())
    return {s: int(found.get(s, 0)) for s in STATUSES}


def per_version(engine: Engine, agent: str) -> list[dict[str, Any]]:
    """Per version that produced experiences: traffic, rewarded count, mean reward with its band, and
    the first and last experience it produced (when it began and stopped serving)."""
    e = experiences.c
    q = (select(e.model_version, func.count(), func.count(e.reward), func.sum(e.reward), func.sum(e.reward * e.reward),
                func.min(e.created_at), func.max(e.created_at))
         .where(e.agent == agent).group_by(e.model_version).order_by(e.model_version))
    out = []
    with engine.connect() as conn:
        for version, n, rewarded, total, squares, first, last in conn.execute(q):
            out.append({"version": int(version), "experiences": int(n), "reward": mean_band(int(rewarded), total, squares),
                        "first_at": _timestamp(first), "last_at": _timestamp(last)})
    return out


def over_time(engine: Engine, agent: str, first: float | None, last: float | None) -> dict[str, Any]:
    """Traffic and reward per time bucket between the agent's ``first`` and ``last`` experience (the
    bucket width chosen from the span, at most MAX_BUCKETS buckets)."""
    if first is None or last is None:
        return {"bucket_s": None, "points": []}
    e = experiences.c
    width = bucket_width(max(1.0, last - first))
    bucket = _bucket(engine, e.created_at, width)
    q = (select(bucket.label("b"), func.count(), func.count(e.reward), func.sum(e.reward), func.sum(e.reward * e.reward),
                func.max(e.model_version))
         .where(e.agent == agent).group_by("b").order_by("b"))
    with engine.connect() as conn:
        points = [{"t": int(b) * width, "experiences": int(n), "newest_version": int(newest),
                   "reward": mean_band(int(rewarded), total, squares)}
                  for b, n, rewarded, total, squares, newest in conn.execute(q)]
    return {"bucket_s": width, "points": points}


def overview(engine: Engine, root: str | Path, agent: str, rollups: Any = None) -> dict[str, Any]:
    """The agent's overview; from ``rollups`` (services.dashboard.rollups.Rollups) once they are ready,
    so its cost is the agent's hours with traffic, not its rows. An agent whose whole history spans an
    hour or less gets buckets under a minute, read from its rows (as does one of 60 hours or less
    whose hours are too old to have kept their minutes)."""
    figures = rollups.figures(agent) if rollups is not None else None
    versions = per_version(engine, agent) if figures is None else figures.versions
    started = [{"version": v["version"], "at": v["first_at"]} for v in versions if v["first_at"] is not None]
    first = min((v["first_at"] for v in versions), default=None)
    last = max((v["last_at"] for v in versions), default=None)
    points = None
    if figures is not None and first is not None and (width := bucket_width(max(1.0, last - first))) >= 60:
        points = figures.over_time(width)
    timeline = over_time(engine, agent, first, last) if points is None else {"bucket_s": width, "points": points}
    return {
        "agent": agent,
        **serving(root, agent),
        "statuses": status_counts(engine, agent) if figures is None else figures.statuses,
        "versions": versions,
        # A version's first experience is when traffic first reached it: the Explorer's reload, as the buffer saw it.
        "reloads": sorted(started, key=lambda s: s["at"]),
        "over_time": timeline,
        "generated_at": time.time(),
        "rollups": rollups.state() if rollups is not None else {"state": "off", "as_of": None},
    }


def trainer(engine: Engine, agent: str, *, limit: int = 5000) -> dict[str, Any]:
    """The agent's newest ``limit`` Trainer steps, oldest first, with the figures each step recorded."""
    t = trainer_steps.c
    q = (select(t.step, t.version, t.consumed, t.discarded, t.metrics, t.created_at)
         .where(t.agent == agent).order_by(t.id.desc()).limit(limit))
    with engine.connect() as conn:
        rows = conn.execute(q).all()[::-1]
        total = conn.execute(select(func.count()).where(t.agent == agent)).scalar() or 0
    steps = []
    objective: dict[str, None] = {}  # the objectives' own figures, in order of first appearance
    for step, version, consumed, discarded, metrics, created in rows:
        m = metrics or {}
        own = [k for k in m.get("objective_figures") or () if isinstance(k, str) and k not in TRAINER_FIGURES]
        objective.update(dict.fromkeys(own))
        steps.append({"step": step, "version": version, "consumed": consumed, "discarded": discarded,
                      "at": _timestamp(created), "published": m.get("published"),
                      **{k: m.get(k) for k in (*TRAINER_FIGURES, *own)
                         if isinstance(m.get(k), (int, float)) and not isinstance(m.get(k), bool)}})
    return {"agent": agent, "steps": steps, "total_steps": int(total), "figures": list(TRAINER_FIGURES),
            "objective_figures": list(objective)}


def _manifest(root: str | Path, agent: str, version: int) -> dict[str, Any] | None:
    try:
        m = json.loads((checkpoints.version_dir(root, agent, version) / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) else None


def versions(engine: Engine, root: str | Path, agent: str, rollups: Any = None) -> dict[str, Any]:
    """Each version with its lineage: its parent, the step that made it, how many experiences trained
    it (and a search for them), how it served (from ``rollups`` once ready), and every release
    decision about it."""
    e, d, t = experiences.c, release_decisions.c, trainer_steps.c
    with engine.connect() as conn:
        trained = dict(conn.execute(select(e.trained_in, func.count())
                                    .where(e.agent == agent, e.trained_in.is_not(None),
                                           e.status == ExperienceStatus.CONSUMED.value)
                                    .group_by(e.trained_in)).all())
        decisions = conn.execute(select(d.version, d.decision, d.serving, d.actor, d.reason, d.figures, d.created_at)
                                 .where(d.agent == agent).order_by(d.id)).all()
        steps = dict(conn.execute(select(t.version, func.max(t.step)).where(t.agent == agent).group_by(t.version)).all())
    figures = rollups.figures(agent) if rollups is not None else None
    served = {v["version"]: v for v in (per_version(engine, agent) if figures is None else figures.versions)}
    on_disk = set(checkpoints.list_versions(root, agent))
    numbers = sorted(on_disk | set(served) | set(trained) | set(steps) | {r.version for r in decisions})
    by_version: dict[int, list[dict[str, Any]]] = {}
    for r in decisions:
        by_version.setdefault(r.version, []).append({
            "decision": r.decision, "serving": r.serving, "actor": r.actor, "reason": r.reason,
            "figures": r.figures, "at": _timestamp(r.created_at)})
    out = []
    for v in numbers:
        m = _manifest(root, agent, v) if v in on_disk else None
        s = served.get(v)
        out.append({
            "version": v,
            "on_disk": v in on_disk,
            "created_at": (m or {}).get("created_at"),
            "parent": (m or {}).get("parent_version"),
            "step": (m or {}).get("step", steps.get(v)),
            "algorithm": (m or {}).get("algorithm"),
            "source": None if m is None else m.get("source", "trainer"),  # publish: kaizen publish
            "experience_count": (m or {}).get("experience_count"),
            "trained_on": int(trained.get(v, 0)),
            "guard": (m or {}).get("guard"),
            "served": s["experiences"] if s else 0,
            "reward": s["reward"] if s else None,
            "first_served_at": s["first_at"] if s else None,
            "decisions": by_version.get(v, []),
        })
    return {"agent": agent, **serving(root, agent), "versions": out}


@dataclass(frozen=True)
class ExperienceFilter:
    agents: Sequence[str] | None = None  # the key's agents (None: all)
    agent: str | None = None
    task_id: str | None = None
    run_id: str | None = None
    version: int | None = None
    status: str | None = None
    trained_in: int | None = None
    min_reward: float | None = None
    max_reward: float | None = None


_SUMMARY = (experiences.c.seq, experiences.c.experience_id, experiences.c.completion_id, experiences.c.agent,
            experiences.c.model_version, experiences.c.task_id, experiences.c.run_id, experiences.c.status,
            experiences.c.reward, experiences.c.trained_in, experiences.c.finish_reason, experiences.c.created_at)


def search(engine: Engine, f: ExperienceFilter, *, limit: int = 50, before: int | None = None) -> dict[str, Any]:
    """Experiences matching ``f``, newest first, ``limit`` a page; ``next_before`` pages on. A key's
    several agents are read one index range each and merged (an IN list would sort them all)."""
    e = experiences.c
    conds = []
    for column, value in ((e.task_id, f.task_id), (e.run_id, f.run_id), (e.model_version, f.version),
                          (e.status, f.status), (e.trained_in, f.trained_in)):
        if value is not None:
            conds.append(column == value)
    if f.min_reward is not None:
        conds.append(e.reward >= f.min_reward)
    if f.max_reward is not None:
        conds.append(e.reward <= f.max_reward)
    if before is not None:
        conds.append(e.seq < before)
    if f.agent is not None:
        scopes = [f.agent] if f.agents is None or f.agent in f.agents else []
    else:
        scopes = [None] if f.agents is None else list(f.agents)
    rows = []
    with engine.connect() as conn:
        for agent in scopes:
            where = conds + ([e.agent == agent] if agent is not None else [])
            q = select(*_SUMMARY).order_by(e.seq.desc()).limit(limit + 1)
            rows += conn.execute(q.where(and_(*where)) if where else q).all()
    rows = sorted(rows, key=lambda r: r.seq, reverse=True)[:limit + 1]
    page = [dict(r._mapping) | {"created_at": _timestamp(r.created_at)} for r in rows[:limit]]
    return {"experiences": page, "next_before": page[-1]["seq"] if len(rows) > limit else None}


def experience(engine: Engine, experience_id: str) -> dict[str, Any] | None:
    e = experiences.c
    with engine.connect() as conn:
        row = conn.execute(select(experiences).where(e.experience_id == experience_id)).first()
    if row is None:
        return None
    x = dict(row._mapping)
    for key in ("created_at", "updated_at", "purged_at"):
        x[key] = _timestamp(x[key])
    x["prompt_tokens"] = len(x.pop("prompt_token_ids") or [])
    if x.get("hint"):  # the words; the teacher's prompt ids are the Trainer's
        x["hint"] = {k: v for k, v in x["hint"].items() if k != "prompt_token_ids"}
    x["reward_history"] = [{**h, "created_at": _timestamp(h["created_at"])}
                           for h in buffer.reward_history(engine=engine, experience_id=experience_id)]
    return x
