"""Episode pins across replicas (reload.episode_pins: database, the default on PostgreSQL): two real Explorers on one
database and one checkpoint folder; an episode that began on v1 at one replica keeps v1 at the other
after v2 went live there, while new episodes get v2. With pins kept per process, the other replica
would serve it v2 (checked too, so the test can tell the two apart)."""

from __future__ import annotations

import time

import pytest

from tests.integration.adapters import publish_adapter, train_reply_adapter

pytestmark = pytest.mark.integration

ASK = [{"role": "user", "content": "Where should I go?"}]
TARGETS = {1: "Go to paris.", 2: "Go to london."}


@pytest.fixture(scope="module")
def adapters(tiny_model):
    return {v: train_reply_adapter(tiny_model, ASK, t) for v, t in TARGETS.items()}


def _db_url(kind: str, request, tmp_path) -> str:
    return f"sqlite:///{tmp_path}/shared.db" if kind == "sqlite" else request.getfixturevalue("postgres_db_url")


def _turn(ex, run_id):
    r = ex.client.chat.completions.create(model="guide", messages=ASK, temperature=0, max_tokens=12,
                                          metadata={"task_id": "trip", "run_id": str(run_id)})
    return r.system_fingerprint


def _wait_version(ex, version, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if {m["id"]: m for m in ex.http.get("/v1/models").json()["data"]}["guide"]["version"] == version:
            return
        time.sleep(0.05)
    raise AssertionError(f"version {version} was not loaded within {timeout}s")


@pytest.mark.parametrize("db, store", [("sqlite", "database"), ("postgres", "database"), ("sqlite", "process")])
def test_an_episode_keeps_its_version_whichever_replica_serves_it(make_explorer, adapters, tmp_path, request, db, store):
    db_url = _db_url(db, request, tmp_path)
    root = tmp_path / "checkpoints"
    publish_adapter(adapters[1], root, "guide", 1)
    a, b = (make_explorer(f"buffer.url={db_url}", f"checkpoints.root={root}", f"reload.episode_pins={store}")
            for _ in range(2))
    assert _turn(a, 0) == "kaizen-guide-v1"  # episode 0's first call, at replica a
    publish_adapter(adapters[2], root, "guide", 2)
    for ex in (a, b):
        _wait_version(ex, 2)
    if store == "process":  # replica b never saw episode 0: it serves the current version
        assert _turn(b, 0) == "kaizen-guide-v2"
        return
    assert _turn(b, 0) == "kaizen-guide-v1"  # its second call, at replica b: still v1
    assert _turn(a, 0) == "kaizen-guide-v1"
    assert _turn(b, 1) == "kaizen-guide-v2"  # a new episode starts on v2 ...
    assert _turn(a, 1) == "kaizen-guide-v2"  # ... and stays there at the other replica
    b.http.get("/experiences", params={"task_id": "trip"})  # a GET flushes its own replica's recorder first
    rows = a.http.get("/experiences", params={"task_id": "trip", "limit": 100}).json()["data"]
    assert sorted((r["run_id"], r["model_version"]) for r in rows) == [("0", 1)] * 3 + [("1", 2)] * 2
