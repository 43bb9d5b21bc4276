"""Per-minute rollups of the buffer's experiences, held in the dashboard's memory, so that an overview
reads an agent's hours with traffic instead of its every row.

A cell is what one agent's experiences of one version created in one minute add up to: per status,
how many, how many carry a reward, the rewards' sum and sum of squares; and the first and last
``created_at``. A cell is never adjusted by arithmetic. Whenever a row in it may have changed, it is
computed again from the buffer (a range of ``ix_experiences_dashboard``), so late rewards, status
changes, retention and deletions leave no drift, and the figures are the direct queries' own. An
hour's cells are summed into a block when one of them changes, and an agent's figures are summed
from its blocks: an overview costs the agent's hours with traffic.

The dashboard writes nothing, so it learns what changed from the buffer itself: every write stamps
``updated_at`` (read through ``ix_experiences_changes``), and every deletion leaves a tombstone that
names the agent, version and creation time. Each pass reads the changes stamped since the previous
pass began, less ``change_margin_s``: a write is seen as long as its writer's clock ran behind the
dashboard's, plus the time its transaction waited for a lock, by less than that margin. A
tombstone from an older Kaizen (no agent in it), or ``rebuild_s``, computes every cell again.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any, Iterable

from sqlalchemy import func, inspect, select
from sqlalchemy.engine import Connection, Engine

from services.common.buffer import experiences, tombstones
from services.dashboard import queries

log = logging.getLogger(__name__)

MINUTE = 60
HOUR = 3600
# Hours newer than this keep their cells (and minutes): the buckets under an hour of an agent whose
# whole history spans under 60 hours (bucket_width), and cheap passes where traffic is arriving.
FINE_HOURS = 72
# Dirty minutes of one agent and version this close together are read as one range (computing a
# clean minute again is harmless, and one range costs less than many).
_GAP_MINUTES = 10


@dataclass(frozen=True, slots=True)
class Cell:
    """One agent's experiences of one version created in one minute."""

    statuses: dict[str, tuple[int, int, float, float]]  # status: (count, with a reward, sum, sum of squares)
    first: float  # the first and last created_at (seconds since 1970)
    last: float


@dataclass(frozen=True, slots=True)
class Block:
    """One agent's cells of one hour, summed: the figures are summed from these, so an overview costs
    the agent's hours with traffic (a block is summed again from its cells when one of them changes)."""

    statuses: dict[str, int]
    versions: dict[int, tuple[int, int, float, float, float, float]]  # count, rewarded, sum, squares, first, last
    # (minute, count, rewarded, sum, squares, newest version); None once the hour is older than the
    # rollups' fine_hours and its cells were let go
    minutes: list[tuple[int, int, int, float, float, int]] | None
    total: tuple[int, int, float, float, int]  # count, rewarded, sum, squares, newest version


def _block(cells: Iterable[tuple[tuple[int, int], Cell]]) -> Block:
    statuses: dict[str, int] = {}
    versions: dict[int, list] = {}
    minutes: dict[int, list] = {}
    for (version, minute), cell in cells:
        v = versions.setdefault(version, [0, 0, 0.0, 0.0, cell.first, cell.last])
        m = minutes.setdefault(minute, [0, 0, 0.0, 0.0, version])
        for status, (n, rewarded, total, squares) in cell.statuses.items():
            statuses[status] = statuses.get(status, 0) + n
            for agg in (v, m):
                agg[0] += n
                agg[1] += rewarded
                agg[2] += total
                agg[3] += squares
        v[4], v[5] = min(v[4], cell.first), max(v[5], cell.last)
        m[4] = max(m[4], version)
    rows = [(minute, *agg) for minute, agg in sorted(minutes.items())]
    return Block(statuses=statuses, versions={v: tuple(agg) for v, agg in versions.items()}, minutes=rows,
                 total=(sum(r[1] for r in rows), sum(r[2] for r in rows), sum(r[3] for r in rows),
                        sum(r[4] for r in rows), max((r[5] for r in rows), default=0)))


@dataclass(frozen=True)
class AgentFigures:
    """An agent's figures summed from its hour blocks: what ``queries.overview`` would read from the rows."""

    statuses: dict[str, int]
    versions: list[dict[str, Any]]  # as queries.per_version
    blocks: list[tuple[int, Block]]  # (hour, block), in time order

    def over_time(self, width: int) -> list[dict[str, Any]] | None:
        """Traffic and reward per ``width``-second bucket (whole minutes), as queries.over_time: summed
        from whole hours when the width is whole hours, else from the minutes (None when an hour kept
        none: the caller reads the rows, of a span under 60 hours)."""
        if width % MINUTE:
            raise ValueError(f"a rollup's bucket is whole minutes, not {width} s")
        if width % HOUR and any(block.minutes is None for _, block in self.blocks):
            return None
        if width % HOUR == 0:
            spans = ((hour * HOUR, block.total) for hour, block in self.blocks)
        else:
            spans = ((minute * MINUTE, tuple(rest)) for _, block in self.blocks for minute, *rest in block.minutes)
        buckets: dict[int, list] = {}
        for start, (n, rewarded, total, squares, newest) in spans:
            b = buckets.setdefault(start // width, [0, 0, 0.0, 0.0, newest])
            b[0] += n
            b[1] += rewarded
            b[2] += total
            b[3] += squares
            b[4] = max(b[4], newest)
        return [{"t": b * width, "experiences": n, "newest_version": newest,
                 "reward": queries.mean_band(rewarded, total if rewarded else None, squares)}
                for b, (n, rewarded, total, squares, newest) in sorted(buckets.items())]


def _summarise(blocks: list[tuple[int, Block]]) -> AgentFigures:
    statuses = dict.fromkeys(queries.STATUSES, 0)
    versions: dict[int, list] = {}
    for _, block in blocks:
        for status, n in block.statuses.items():
            statuses[status] = statuses.get(status, 0) + n
        for version, (n, rewarded, total, squares, first, last) in block.versions.items():
            v = versions.setdefault(version, [0, 0, 0.0, 0.0, first, last])
            v[0] += n
            v[1] += rewarded
            v[2] += total
            v[3] += squares
            v[4], v[5] = min(v[4], first), max(v[5], last)
    return AgentFigures(
        statuses=statuses,
        versions=[{"version": version, "experiences": n,
                   "reward": queries.mean_band(rewarded, total if rewarded else None, squares),
                   "first_at": first, "last_at": last}
                  for version, (n, rewarded, total, squares, first, last) in sorted(versions.items())],
        blocks=sorted(blocks))


def _at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, timezone.utc)


def read_cells(conn: Connection, engine: Engine, agent: str, version: int | None = None,
               minutes: tuple[int, int] | None = None) -> dict[tuple[int, int], Cell]:
    """The cells of ``agent`` (of one ``version``, and the minutes ``first..last`` inclusive, when given),
    computed from the rows."""
    e = experiences.c
    minute = queries._bucket(engine, e.created_at, MINUTE).label("m")
    q = select(e.model_version, minute, e.status, func.count(), func.count(e.reward), func.sum(e.reward),
               func.sum(e.reward * e.reward), func.min(e.created_at), func.max(e.created_at)).where(e.agent == agent)
    if version is not None:
        q = q.where(e.model_version == version)
    if minutes is not None:
        q = q.where(e.created_at >= _at(minutes[0] * MINUTE), e.created_at < _at((minutes[1] + 1) * MINUTE))
    found: dict[tuple[int, int], list] = {}
    for v, m, status, n, rewarded, total, squares, first, last in conn.execute(q.group_by(e.model_version, "m", e.status)):
        key = (int(v), int(m))
        first, last = queries._timestamp(first), queries._timestamp(last)
        c = found.setdefault(key, [{}, first, last])
        c[0][status] = (int(n), int(rewarded), float(total or 0.0), float(squares or 0.0))
        c[1], c[2] = min(c[1], first), max(c[2], last)
    return {key: Cell(statuses, first, last) for key, (statuses, first, last) in found.items()}


def changed_cells(conn: Connection, engine: Engine, since: datetime
                  ) -> tuple[dict[tuple[str, int, int], dict[float, int]], float | None]:
    """The cells ((agent, version, minute): {stamp: how many rows carry it} of the writes and deletions
    in it) whose rows
    were written or deleted at or after ``since``, and when the last deletion that names no cell was
    made (a tombstone of an older Kaizen: every cell may have changed), or None."""
    e, t = experiences.c, tombstones.c
    dirty: dict[tuple[str, int, int], dict[float, int]] = {}
    written = select(e.agent, e.model_version, queries._bucket(engine, e.created_at, MINUTE), e.updated_at).where(
        e.updated_at >= since)
    deleted = select(t.agent, t.model_version, queries._bucket(engine, t.created_at, MINUTE), t.deleted_at).where(
        t.deleted_at >= since)
    unknown: float | None = None
    # No DISTINCT: with it, SQLite's planner scans a whole index instead of this range of ix_experiences_changes.
    for q in (written, deleted):
        for agent, version, minute, at in conn.execute(q):
            if agent is None or version is None or minute is None:
                unknown = max(unknown or 0.0, queries._timestamp(at))
            else:
                stamps = dirty.setdefault((agent, int(version), int(minute)), {})
                stamps[queries._timestamp(at)] = stamps.get(queries._timestamp(at), 0) + 1
    return dirty, unknown


def schema_lacks(engine: Engine) -> list[str]:
    """What the rollups need that a buffer made by an older Kaizen lacks until an Explorer or Trainer
    of this version has started on it (without the index, every pass would scan the table)."""
    inspector = inspect(engine)
    missing = []
    if "ix_experiences_changes" not in {i["name"] for i in inspector.get_indexes("experiences")}:
        missing.append("index ix_experiences_changes")
    if "agent" not in {c["name"] for c in inspector.get_columns("tombstones")}:
        missing.append("column tombstones.agent")
    return missing


def ranges(minutes: Iterable[int], gap: int = _GAP_MINUTES) -> list[tuple[int, int]]:
    """Sorted minutes as inclusive ranges, merging those at most ``gap`` minutes apart."""
    out: list[list[int]] = []
    for m in sorted(minutes):
        if out and m - out[-1][1] <= gap:
            out[-1][1] = m
        else:
            out.append([m, m])
    return [(a, b) for a, b in out]


def _coarse(block: Block) -> Block:
    return replace(block, minutes=None)


def _by_hour(cells: dict[tuple[int, int], Cell]) -> dict[int, dict[tuple[int, int], Cell]]:
    hours: dict[int, dict[tuple[int, int], Cell]] = {}
    for (version, minute), cell in cells.items():
        hours.setdefault(minute * MINUTE // HOUR, {})[(version, minute)] = cell
    return hours


class Rollups:
    """Every agent's hour blocks, and the cells of its last ``fine_hours`` hours, kept current by
    ``refresh`` (the dashboard calls it every ``refresh_s`` on a thread of its own; ``figures``
    answers requests meanwhile).

    An older hour keeps its block alone (no cells, no minutes): memory grows with an agent's hours,
    not its minutes. A change to such an hour (a late reward, a Trainer step or retention reaching
    old rows) computes its whole block again from its rows."""

    def __init__(self, engine: Engine, *, margin_s: float, rebuild_s: float = 0.0, stale_s: float = 60.0,
                 fine_hours: int = FINE_HOURS):
        self._engine = engine
        self.fine_hours = fine_hours
        self.margin_s = margin_s
        self.rebuild_s = rebuild_s
        self.stale_s = stale_s  # no pass succeeded for this long: figures() is None (the caller reads the rows)
        self._lock = threading.Lock()
        self._cells: dict[str, dict[int, dict[tuple[int, int], Cell]]] = {}  # agent: fine hour: (version, minute): cell
        self._blocks: dict[str, dict[int, Block]] = {}  # agent: hour: its cells summed
        self._generation: dict[str, int] = {}
        self._cache: dict[str, tuple[int, AgentFigures]] = {}
        self.as_of: float | None = None  # when the last pass began (this process's clock)
        self.built_at: float | None = None
        self._fine = 0  # the first hour that keeps its cells: it only moves forward, whatever the clock does
        self._unknown_handled = 0.0  # the last unnamed deletion a build has taken in
        self._lacks: list[str] | None = None  # what the buffer's schema lacks (None: not checked yet)
        self._rebuilding = False
        # the stamps (and how many rows carry each) of each cell's changes in the margin when it was last
        # computed: a pass computes again only the cells with a change not seen yet (a write that became
        # visible since, even one stamped in the same microsecond as another)
        self._seen: dict[tuple[str, int, int], dict[float, int]] = {}
        self.cells_read = 0  # cells computed from the rows since this process started (all passes)
        self.builds = 0

    def state(self) -> dict[str, Any]:
        if self._lacks:
            return {"state": "off", "as_of": None, "reason": "the buffer lacks " + ", ".join(self._lacks)}
        if self.as_of is None:
            return {"state": "building", "as_of": None}
        # a rebuild (rebuild_s) may take minutes on a large buffer: the figures stay those of the last pass meanwhile
        stale = time.time() - self.as_of > self.stale_s and not self._rebuilding
        return {"state": "stale" if stale else "ready", "as_of": self.as_of}

    def build(self) -> None:
        """Every agent's cells and blocks, computed afresh from the rows."""
        self._rebuilding = self.as_of is not None
        try:
            self._build()
        finally:
            self._rebuilding = False

    def _build(self) -> None:
        started = time.time()
        fine = self._fine_from()
        fresh: dict[str, dict[int, dict[tuple[int, int], Cell]]] = {}
        blocks: dict[str, dict[int, Block]] = {}
        count = 0
        with self._engine.connect() as conn:
            names = sorted(queries._distinct_agents(conn, experiences.c.agent))
        for agent in names:  # one agent's cells at a time, each its own read transaction (SQLite's WAL checkpoints between)
            with self._engine.connect() as conn:
                hours = _by_hour(read_cells(conn, self._engine, agent))
            count += sum(len(cells) for cells in hours.values())
            blocks[agent] = {hour: _block(cells.items()) if hour >= fine else _coarse(_block(cells.items()))
                             for hour, cells in hours.items()}
            fresh[agent] = {hour: cells for hour, cells in hours.items() if hour >= fine}
        with self._lock:
            self._seen = {}  # what the next pass finds in the margin is computed again once
            for agent in set(self._cells) | set(fresh):
                self._cells[agent] = fresh.get(agent, {})
                self._blocks[agent] = blocks.get(agent, {})
                self._generation[agent] = self._generation.get(agent, 0) + 1
            self.as_of = self.built_at = started
            self.cells_read += count
            self.builds += 1
        log.info("dashboard rollups: %d cells of %d agents computed from the rows in %.1f s", count, len(fresh),
                 time.time() - started)

    def refresh(self) -> None:
        """Compute again every cell written or deleted since the last pass began (less the margin),
        and the blocks of their hours; the first pass, an unknown deletion and every ``rebuild_s``
        compute them all."""
        if self._lacks is None or self._lacks:
            lacks = schema_lacks(self._engine)
            if lacks and lacks != self._lacks:
                log.warning("dashboard rollups off until an Explorer or Trainer of this version has started on the "
                            "buffer (it lacks %s): the pages read the rows", ", ".join(lacks))
            self._lacks = lacks
            if lacks:
                return
        if self.as_of is None or self.built_at is None or (self.rebuild_s and time.time() - self.built_at >= self.rebuild_s):
            self.build()
            return
        started = time.time()
        fine = self._fine_from()
        fresh: list[tuple[str, int, tuple[int, int], dict[tuple[int, int], Cell]]] = []
        whole: dict[tuple[str, int], dict[tuple[int, int], Cell]] = {}  # (agent, old hour): all its cells
        with self._engine.connect() as conn:
            window, unknown = changed_cells(conn, self._engine, _at(self.as_of - self.margin_s))
            if unknown is not None and unknown <= self._unknown_handled:
                unknown = None  # a build after it took it in
            dirty: dict[tuple[str, int], set[int]] = {}
            for (agent, version, minute), stamps in window.items():
                seen = self._seen.get((agent, version, minute), {})
                if any(n > seen.get(stamp, 0) for stamp, n in stamps.items()):
                    dirty.setdefault((agent, version), set()).add(minute)
            if unknown is None:
                with self._lock:  # hours whose block kept no cells are read whole, whatever the boundary says
                    coarse = {agent: {h for h, b in self._blocks.get(agent, {}).items() if b.minutes is None}
                              for agent, _ in dirty}
                whole_hour = lambda agent, m: m * MINUTE // HOUR < fine or m * MINUTE // HOUR in coarse[agent]  # noqa: E731
                old: dict[tuple[str, int], set[int]] = {}  # (agent, hour read whole): versions in it
                for (agent, version), minutes in sorted(dirty.items()):
                    for span in ranges(m for m in minutes if not whole_hour(agent, m)):
                        fresh.append((agent, version, span, read_cells(conn, self._engine, agent, version, span)))
                    for m in minutes:
                        if whole_hour(agent, m):
                            old.setdefault((agent, m * MINUTE // HOUR), set()).add(version)
                with self._lock:
                    for (agent, hour), versions in old.items():
                        block = self._blocks.get(agent, {}).get(hour)
                        versions |= set(block.versions) if block is not None else set()
                for (agent, hour), versions in sorted(old.items()):
                    span = (hour * HOUR // MINUTE, (hour + 1) * HOUR // MINUTE - 1)
                    whole[(agent, hour)] = {k: c for v in sorted(versions)
                                            for k, c in read_cells(conn, self._engine, agent, v, span).items()}
        if unknown is not None:
            log.info("dashboard rollups: a deletion by an older Kaizen names no agent: computing every cell again")
            self.build()
            self._unknown_handled = unknown
            return
        with self._lock:
            touched: dict[str, set[int]] = {}
            for agent, version, (lo, hi), cells in fresh:
                hours = self._cells.setdefault(agent, {})
                for minute in range(lo, hi + 1):
                    hours.get(minute * MINUTE // HOUR, {}).pop((version, minute), None)
                    touched.setdefault(agent, set()).add(minute * MINUTE // HOUR)
                for (v, minute), cell in cells.items():
                    hours.setdefault(minute * MINUTE // HOUR, {})[(v, minute)] = cell
                self.cells_read += len(cells)
            for agent, changed in touched.items():
                hours, blocks = self._cells[agent], self._blocks.setdefault(agent, {})
                for hour in changed:
                    if hours.get(hour):
                        blocks[hour] = _block(hours[hour].items())
                    else:
                        hours.pop(hour, None)
                        blocks.pop(hour, None)
                self._generation[agent] = self._generation.get(agent, 0) + 1
            for (agent, hour), cells in whole.items():
                blocks = self._blocks.setdefault(agent, {})
                if cells:
                    blocks[hour] = _coarse(_block(cells.items()))
                else:
                    blocks.pop(hour, None)
                self._generation[agent] = self._generation.get(agent, 0) + 1
                self.cells_read += len(cells)
            for agent, hours in self._cells.items():  # hours that grew old let their cells go
                for hour in [h for h in hours if h < fine]:
                    del hours[hour]
                    if hour in self._blocks.get(agent, {}):
                        self._blocks[agent][hour] = _coarse(self._blocks[agent][hour])
                    self._generation[agent] = self._generation.get(agent, 0) + 1
            self._seen = window  # every change in it is in the cells now: seen before, or just computed again
            self.as_of = started

    def _fine_from(self) -> int:
        """The first hour that keeps its cells (never earlier than before: a clock set back must not
        make an hour whose cells were let go look as if it still had them)."""
        self._fine = max(self._fine, int(time.time() // HOUR) - self.fine_hours)
        return self._fine

    def figures(self, agent: str) -> AgentFigures | None:
        """The agent's figures summed from its hour blocks; None until the first pass, or while no
        pass succeeds."""
        if self.state()["state"] != "ready":
            return None
        with self._lock:
            generation = self._generation.get(agent, 0)
            hit = self._cache.get(agent)
            if hit is not None and hit[0] == generation:
                return hit[1]
            blocks = list(self._blocks.get(agent, {}).items())
        figures = _summarise(blocks)
        with self._lock:
            self._cache[agent] = (generation, figures)
        return figures

    def run(self, every_s: float, stop: threading.Event) -> None:
        """Refresh every ``every_s`` until ``stop`` is set; a failed pass is logged and tried again."""
        failing = False
        while not stop.is_set():
            try:
                self.refresh()
                if failing:
                    log.warning("dashboard rollups: reading the buffer works again")
                failing = False
            except Exception as e:  # the database is down or refusing: the overview reads the rows meanwhile
                if not failing:
                    log.warning("dashboard rollups: a pass failed (%s: %s); retrying every %.0f s", type(e).__name__, e,
                                every_s)
                failing = True
            stop.wait(every_s)
