"""The dashboard's per-minute rollups: after every kind of write the buffer takes (new rows, rewards,
commits, a Trainer step, retention, a user's deletion, a new agent), a pass makes the overview
from the rollups equal the one read from the rows; a write stamped within the margin before the
last pass is seen, one stamped before the margin is the documented gap. On SQLite here;
tests/integration/common/test_dashboard_postgres.py runs them again on PostgreSQL."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import delete, insert, select, text, update

from services.common import buffer
from services.common.buffer import experiences, tombstones
from services.common.records import Experience
from services.dashboard import queries
from services.dashboard.rollups import AgentFigures, Rollups, ranges
from tests.unit.common.test_dashboard_queries import T0, _exp, buffer_url, filled  # noqa: F401 - fixtures


def _direct(db, root, agent):
    return queries.overview(db, root, agent)


def _same(a: dict, b: dict) -> None:
    """Two overviews agree (floats to 1e-9: a sum's order may differ), but for when they were made."""
    for o in (a, b):
        o.pop("generated_at"), o.pop("rollups")
    _nested(a, b)


def _nested(a, b) -> bool:
    """Equal, floats to a relative 1e-9."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (a, b)
        return all(_nested(a[k], b[k]) for k in a)
    if isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), (a, b)
        return all(_nested(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12)
        return True
    assert a == b
    return True


def _check(db, root, rollups, agents=("a", "b")):
    for agent in agents:
        ours = queries.overview(db, root, agent, rollups)
        assert ours["rollups"]["state"] == "ready"
        _same(ours, _direct(db, root, agent))


def _late(i: int, agent: str, version: int, hours: float, user: str | None = None) -> Experience:
    x = _exp(i, agent, version, None, seconds=hours * 3600)
    return x.model_copy(update={"user_id": user}) if user else x


# every hour keeps its cells and minutes; none does (the fixture's rows are weeks old: the default)
FINE = pytest.mark.parametrize("fine_hours", [10**6, 0], ids=["fine", "coarse"])


@FINE
def test_every_kind_of_write_is_rolled_up_exactly(filled, fine_hours):
    db, root, rewards = filled
    # eight days of traffic: 2-hour buckets, summed from hour blocks; five hours of d's: 300 s buckets,
    # summed from minutes
    buffer.insert_experiences(engine=db, records=[_late(200 + i, "a", 2, 24 * (1 + i), user="u1") for i in range(8)])
    buffer.insert_experiences(engine=db, records=[_late(400 + i, "d", i % 2, 1 + i / 2) for i in range(10)])
    rollups = Rollups(db, margin_s=120, fine_hours=fine_hours)
    assert rollups.figures("a") is None and rollups.state()["state"] == "building"
    rollups.refresh()
    _check(db, root, rollups, agents=("a", "b", "d"))
    o = queries.overview(db, root, "a", rollups)
    assert o["over_time"]["bucket_s"] == 7200 and o["rollups"]["state"] == "ready"
    assert sum(p["experiences"] for p in o["over_time"]["points"]) == 68
    d = queries.overview(db, root, "d", rollups)
    assert d["over_time"]["bucket_s"] == 300 and len(d["over_time"]["points"]) == 10
    # rewards, a commit, a Trainer step, a discard: status and reward move between cells' columns
    buffer.apply_feedback(engine=db, msg_ids=["c200", "c201", "c55"], reward=0.25, feedback={})
    buffer.commit_experiences(engine=db, msg_ids=["c200", "c201", "c45"])
    buffer.consume_batch(engine=db, agent="a", step=3, version=3, consumed={"c32-0": rewards["c32-0"], "c200-0": 0.25},
                         discarded=["c33-0"], state_ref=None, metrics={})
    buffer.apply_feedback(engine=db, msg_ids=["c0"], reward=-1.0, feedback={})  # a late reward on a trained row
    buffer.insert_experiences(engine=db, records=[_late(300, "c", 0, 2)])  # a new agent
    rollups.refresh()
    _check(db, root, rollups, agents=("a", "b", "c", "d"))
    # a user's deletion leaves a tombstone naming the cells; retention purges (and discards) text
    assert buffer.delete_user_data(engine=db, user_id="u1")["deleted"] == 8
    assert buffer.purge_text(engine=db, before=T0 + timedelta(seconds=100)) == 15  # 10 of a, 5 of b
    rollups.refresh()
    _check(db, root, rollups, agents=("a", "b", "c", "d"))
    assert sum(queries.overview(db, root, "a", rollups)["statuses"].values()) == 60
    # the versions page's traffic comes from the same cells
    _nested(queries.versions(db, root, "a", rollups), queries.versions(db, root, "a"))


def test_a_pass_reads_only_the_changed_cells_and_a_rebuild_reads_all(filled):
    db, root, _ = filled
    rollups = Rollups(db, margin_s=120, fine_hours=10**6)
    rollups.refresh()
    built = rollups.cells_read
    assert built == 12 + 1  # a: 10 minutes, two of them with two versions; b: one minute
    buffer.apply_feedback(engine=db, msg_ids=["c59"], reward=1.0, feedback={})
    rollups.refresh()
    # within the margin every cell written since the build is read again: the whole fixture here
    again = rollups.cells_read - built
    assert 1 <= again <= built
    # a pass that finds in the margin only changes it has taken in already computes nothing
    read = rollups.cells_read
    rollups.refresh()
    assert rollups.cells_read == read
    buffer.apply_feedback(engine=db, msg_ids=["c58"], reward=0.5, feedback={})
    rollups.refresh()
    assert rollups.cells_read - read == 1  # minute 9 of v2: the one new change
    _check(db, root, rollups)
    quiet = Rollups(db, margin_s=0, fine_hours=10**6)
    quiet.refresh()
    before = quiet.cells_read
    buffer.apply_feedback(engine=db, msg_ids=["c59"], reward=0.5, feedback={})
    quiet.refresh()
    assert quiet.cells_read - before == 1  # minute 9 of v2 alone
    _check(db, root, quiet)
    # an hour too old to keep its cells is read whole: a's 12 cells of 12:00-13:00
    coarse = Rollups(db, margin_s=0, fine_hours=0)
    coarse.refresh()
    assert coarse._cells["a"] == {} and len(coarse._blocks["a"]) == 1
    before = coarse.cells_read
    buffer.apply_feedback(engine=db, msg_ids=["c59"], reward=0.75, feedback={})
    coarse.refresh()
    assert coarse.cells_read - before == 12
    _check(db, root, coarse)


@FINE
def test_a_write_stamped_before_the_margin_is_missed_until_a_rebuild(filled, fine_hours):
    db, root, _ = filled
    buffer.insert_experiences(engine=db, records=[_late(500, "a", 2, 2)])  # a row two hours after the rest
    with buffer.write_transaction(db) as conn:  # the fixture's rows were written an hour ago
        conn.execute(update(experiences).values(updated_at=datetime.now(timezone.utc) - timedelta(hours=1)))
    rollups = Rollups(db, margin_s=30, rebuild_s=0, fine_hours=fine_hours)
    rollups.refresh()
    as_of = rollups.as_of

    def stamped(xid: str, reward: float, behind_s: float) -> None:
        """A write whose writer's clock ran ``behind_s`` behind the dashboard's."""
        with buffer.write_transaction(db) as conn:
            conn.execute(update(experiences).where(experiences.c.experience_id == xid)
                         .values(reward=reward, updated_at=datetime.fromtimestamp(as_of - behind_s, timezone.utc)))

    stamped("c1-0", 0.9, behind_s=20)  # within the margin: seen
    rollups.refresh()
    _check(db, root, rollups)
    stamped("c500-0", 0.9, behind_s=600)  # ten minutes behind (and in another hour): not seen by a pass...
    rollups.refresh()
    with pytest.raises(AssertionError):
        _check(db, root, rollups)
    rollups.build()  # ...until every cell is computed again (rebuild_s, or a restart)
    _check(db, root, rollups)


def test_figures_are_cached_until_a_cell_of_the_agent_changes(filled):
    db, _, _ = filled
    rollups = Rollups(db, margin_s=0)
    rollups.refresh()
    first = rollups.figures("a")
    assert isinstance(first, AgentFigures) and rollups.figures("a") is first
    rollups.refresh()  # nothing changed
    assert rollups.figures("a") is first
    buffer.apply_feedback(engine=db, msg_ids=["c58"], reward=1.0, feedback={})
    rollups.refresh()
    assert rollups.figures("a") is not first and rollups.figures("a").statuses["rewarded"] == 11
    with pytest.raises(ValueError, match="whole minutes"):
        first.over_time(90)
    # no pass for longer than stale_s: the pages read the rows, unless a rebuild is what takes that long
    rollups.as_of -= 3600
    assert rollups.state()["state"] == "stale" and rollups.figures("a") is None
    rollups._rebuilding = True
    assert rollups.state()["state"] == "ready" and rollups.figures("a") is not None


def test_a_late_write_stamped_in_the_same_microsecond_as_one_taken_in_is_still_seen(filled):
    db, root, _ = filled
    rollups = Rollups(db, margin_s=120, fine_hours=10**6)
    rollups.refresh()
    buffer.insert_experiences(engine=db, records=[_exp(900, "a", 1, None, seconds=0)])
    rollups.refresh()  # takes in c900
    with db.connect() as conn:
        stamp, created = conn.execute(select(experiences.c.updated_at, experiences.c.created_at)
                                      .where(experiences.c.experience_id == "c900-0")).one()
    # another writer's row in the same cell, stamped in the same microsecond, commits after that pass
    row = buffer.recording._row(_exp(901, "a", 1, None, seconds=0).model_copy(update={"created_at": created}), stamp)
    with buffer.write_transaction(db) as conn:
        conn.execute(insert(experiences), [row])
    rollups.refresh()
    _check(db, root, rollups)


def test_a_clock_set_back_never_rebuilds_an_old_hour_from_part_of_its_cells(filled):
    db, root, _ = filled
    rollups = Rollups(db, margin_s=0, fine_hours=0)
    rollups.refresh()  # every hour of the fixture kept its block alone
    rollups.fine_hours = 10**6  # as if the clock went back past them all
    buffer.apply_feedback(engine=db, msg_ids=["c59"], reward=0.5, feedback={})
    rollups.refresh()
    _check(db, root, rollups)


def test_a_deletion_naming_no_cell_rebuilds_once(filled):
    db, root, _ = filled
    rollups = Rollups(db, margin_s=120)
    rollups.refresh()
    with buffer.write_transaction(db) as conn:  # a deletion by an older Kaizen: its tombstone names no agent
        conn.execute(delete(experiences).where(experiences.c.experience_id == "c3-0"))
        conn.execute(insert(tombstones).values(experience_id="c3-0", deleted_at=datetime.now(timezone.utc)))
    rollups.refresh()
    assert rollups.builds == 2
    _check(db, root, rollups)
    rollups.refresh()
    rollups.refresh()
    assert rollups.builds == 2  # the same tombstone, still within the margin, is not taken again


def test_a_buffer_an_older_kaizen_made_keeps_the_rollups_off_until_it_is_upgraded(filled):
    db, root, _ = filled
    with buffer.write_transaction(db) as conn:
        conn.execute(text("DROP INDEX ix_experiences_changes"))
    rollups = Rollups(db, margin_s=120)
    rollups.refresh()
    assert rollups.state()["state"] == "off" and "ix_experiences_changes" in rollups.state()["reason"]
    assert rollups.figures("a") is None and rollups.builds == 0
    assert queries.overview(db, root, "a", rollups)["statuses"]["consumed"] == 32  # from the rows
    buffer.create_buffer_engine(db.url.render_as_string(hide_password=False)).dispose()  # an Explorer of this version starts: the index is added
    rollups.refresh()
    assert rollups.state()["state"] == "ready"
    _check(db, root, rollups)


def test_ranges_merge_close_minutes():
    assert ranges([]) == []
    assert ranges([5, 1, 2, 30, 12, 13], gap=10) == [(1, 13), (30, 30)]
    assert ranges([1, 3], gap=1) == [(1, 1), (3, 3)]
