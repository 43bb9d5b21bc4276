"""The episode pins' table (services/common/buffer/pins.py) on SQLite and PostgreSQL: the first
version recorded wins, a pin past its time no longer counts and is replaced, a moved episode takes
the new version, a rejected version's pins go, and a replica that claimed late adopts the winner."""

from __future__ import annotations

import pytest

from services.common import buffer

pytestmark = pytest.mark.integration


@pytest.fixture(params=["sqlite", "postgres"])
def engine(request, tmp_path):
    url = f"sqlite:///{tmp_path}/buffer.db" if request.param == "sqlite" else request.getfixturevalue("postgres_db_url")
    e = buffer.create_buffer_engine(url)
    yield e
    e.dispose()


def test_first_version_recorded_wins_until_its_pin_lapses(engine):
    pins = buffer.pins
    ep = dict(engine=engine, agent="a", task_id="t", run_id="r")
    assert pins.find(**ep, now=100.0, ttl_s=60) is None
    assert pins.claim(**ep, version=3, now=100.0, ttl_s=60) == (3, 100.0)
    assert pins.claim(**ep, version=4, now=101.0, ttl_s=60) == (3, 100.0)  # another replica, later: v3 stands
    assert pins.find(**ep, now=159.0, ttl_s=60) == (3, 100.0)
    assert pins.find(**ep, now=160.0, ttl_s=60) is None  # 60 s after the first call: no longer pinned
    assert pins.claim(**ep, version=4, now=161.0, ttl_s=60) == (4, 161.0)  # the lapsed pin is replaced
    pins.move(**ep, version=5, now=162.0)  # v4 was deleted: the episode goes on with v5
    assert pins.find(**ep, now=163.0, ttl_s=60) == (5, 162.0)
    other = dict(engine=engine, agent="a", task_id="t", run_id="r2")
    assert pins.claim(**other, version=5, now=163.0, ttl_s=60) == (5, 163.0)
    assert pins.forget_version(engine=engine, agent="a", version=5) == 2  # v5 rolled back: both pins go
    assert pins.find(**ep, now=164.0, ttl_s=60) is None and pins.find(**other, now=164.0, ttl_s=60) is None


def test_replicas_that_served_an_episodes_first_calls_at_once_agree_on_the_first_recorded(engine):
    """Replica b served the episode's first call with v2 and claims it off the request's path; replica a
    recorded v1 for it just before: b adopts v1 for the episode's next calls."""
    import asyncio

    from services.explorer.serving.episodes import EpisodePins

    a, b = (EpisodePins(ttl_s=60, max_episodes=10, db=engine) for _ in range(2))

    async def race():
        assert (await a.claim("x", "t", "r", 1))[0] == 1
        b.remember("x", "t", "r", 2)
        b.claim_later("x", "t", "r", 2)
        while b._claims:
            await asyncio.sleep(0.01)
        c = EpisodePins(ttl_s=60, max_episodes=10, db=engine)  # a third replica that never saw it
        found = await c.find("x", "t", "r")
        c.close()
        return found

    found = asyncio.run(race())
    assert b.get("x", "t", "r") == 1 and found[0] == 1
    a.close()
    b.close()
