"""API keys' quotas counted in the database (auth.quotas: database, the default), so that Explorer
replicas on one database share one bucket per key: the bucket rules on SQLite and PostgreSQL, no count
lost when several processes admit at once, a hold of a replica that died lapses, a database that does
not answer leaves each replica counting on its own, and two real Explorers on one PostgreSQL give a
key its quota once, not once per replica."""

from __future__ import annotations

import json
import multiprocessing
import time

import httpx
import pytest

from services.common import buffer
from services.common.http.access import Principal, Quotas, SharedQuotas, key_digest

pytestmark = pytest.mark.integration


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/buffer.db"
    return request.getfixturevalue("postgres_db_url")


@pytest.fixture
def shared(db_url):
    engine = buffer.create_buffer_engine(db_url)
    q = SharedQuotas(engine, hold_s=900)
    try:
        yield q
    finally:
        q.close()
        engine.dispose()


def key(name="k", *, tokens=None, requests=None) -> Principal:
    return Principal(name=name, scopes=frozenset({"chat"}), tokens_per_min=tokens, requests_per_min=requests)


def test_the_bucket_rules_hold_in_the_database(shared):
    """The process Quotas' rules (tests/unit/common/test_quotas.py), each step a transaction."""
    k = key(tokens=100)
    admitted = [shared.reserve_tokens(k, 40, f"h{i}") is None for i in range(4)]
    assert admitted == [True, True, False, False]  # 80 of 100 held; a third would need 40 of the 20 left
    assert shared.reserve_tokens(k, 40, "h4") == pytest.approx(20 * 60 / 100, abs=0.5)
    shared.settle_tokens(k, 40, 12, "h0")  # the first used 12 of its 40: its hold goes, 12 are charged
    shared.drain()
    assert shared.reserve_tokens(k, 40, "h5") is None
    assert shared.admit(k) is None  # a hold never locks the key out of its other endpoints
    big = key("big", tokens=40)
    assert shared.reserve_tokens(big, 90, "b0") is None  # larger than the quota, on a full bucket
    shared.settle_tokens(big, 90, 70, "b0")
    shared.drain()
    assert shared.reserve_tokens(big, 5, "b1") == pytest.approx(35 * 60 / 40, abs=0.5)  # at -30
    assert shared.admit(big) is not None
    slow = key("slow", requests=2)
    assert [shared.admit(slow) for _ in range(3)][:2] == [None, None]
    assert shared.admit(slow) == pytest.approx(30, abs=1)  # one request a 30 s
    free = key("free")
    assert shared.admit(free) is None and shared.reserve_tokens(free, 10**6, "f") is None
    with buffer.create_buffer_engine(str(shared._engine.url)).connect() as conn:  # the free key wrote nothing
        names = {r.name for r in conn.execute(buffer.select(buffer.quotas.quota_buckets.c.name))}
    assert names == {"k", "big", "slow"}


def test_a_hold_whose_request_never_ended_lapses(shared):
    q = SharedQuotas(shared._engine, hold_s=0.5)  # a replica that dies holding 90 of 100
    k = key(tokens=100)
    assert q.reserve_tokens(k, 90, "dead") is None
    assert shared.reserve_tokens(k, 20, "a") is not None  # the survivor sees the hold
    time.sleep(0.7)
    assert shared.reserve_tokens(k, 20, "a") is None  # lapsed: dropped on the way
    q.close()


def _admit_many(url: str, n: int, start: float, out) -> None:
    engine = buffer.create_buffer_engine(url)
    q = SharedQuotas(engine)
    k = key("burst", requests=60)
    while time.time() < start:
        time.sleep(0.001)
    out.put(sum(q.admit(k) is None for _ in range(n)))
    q.close()
    engine.dispose()


def test_several_processes_admitting_at_once_lose_no_count(db_url):
    """Four processes, each 40 requests of one key as fast as they can against 60 a minute: the key's
    60, plus what refilled while they ran (one a second), and never more."""
    buffer.create_buffer_engine(db_url).dispose()  # the tables, before they race
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    start = time.time() + 3.0
    procs = [ctx.Process(target=_admit_many, args=(db_url, 40, start, out)) for _ in range(4)]
    for p in procs:
        p.start()
    admitted = sum(out.get(timeout=120) for _ in procs)
    elapsed = time.time() - start
    for p in procs:
        p.join(30)
    assert 60 <= admitted <= 60 + int(elapsed) + 1, (admitted, elapsed)


def test_a_database_that_does_not_answer_leaves_each_replica_counting_on_its_own(tmp_path):
    engine = buffer.create_buffer_engine("postgresql+psycopg://nobody@127.0.0.1:9/none?connect_timeout=1", create_tables=False)
    q = SharedQuotas(engine)
    k = key(tokens=100, requests=2)
    assert q.admit(k) is None and q.admit(k) is None and q.admit(k) is not None  # the process bucket
    assert q.reserve_tokens(k, 60, "h") is None and q.reserve_tokens(k, 60, "i") is not None
    q.settle_tokens(k, 60, 10, "h")  # settled where it was held
    assert q.reserve_tokens(k, 60, "i") is None
    q.close()
    assert isinstance(q, Quotas)


SECRET = "kz-test-shared-0123456789abcdef"


def test_two_explorers_on_one_postgresql_give_a_key_its_quota_once(make_explorer, postgres_db_url):
    keys = [{"name": "app", "sha256": key_digest(SECRET), "scopes": ["chat"], "requests_per_min": 4}]
    replicas = [make_explorer(f"buffer.url={postgres_db_url}", "auth.keys=" + json.dumps(keys)) for _ in range(2)]
    clients = [httpx.Client(base_url=r.url, headers={"Authorization": f"Bearer {SECRET}"}, timeout=60) for r in replicas]
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    codes = [clients[i % 2].post("/v1/chat/completions", json=body).status_code for i in range(8)]
    # 4 a minute in all (one refills every 15 s: these 8 take well under that), alternating replicas
    assert sorted(codes) == [200] * 4 + [429] * 4, codes
    r = clients[1].post("/v1/chat/completions", json=body)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(r.headers["Retry-After"]) <= 15
    for c in clients:
        c.close()


def test_clock_skew_between_replicas_never_adds_refill(db_url):
    """A replica 1 s behind the others serves a key between two of theirs: no refill is gained."""
    engine = buffer.create_buffer_engine(db_url)
    try:
        admit = lambda now: buffer.quotas.admit(engine=engine, name="k", requests_per_min=60,  # noqa: E731
                                                tokens_per_min=None, now=now)
        assert all(admit(1000.0) is None for _ in range(59))  # one left at t=1000
        assert admit(999.0) is None  # the lagging replica takes it: its stamp must stay 1000, not go to 999
        # 0.5 s after 1000: half a request refilled, refused (from 999 it would count 1.5 s and admit)
        assert admit(1000.5) == pytest.approx(0.5)
        assert admit(1001.0) is None
    finally:
        engine.dispose()
