"""Hot reload: a new version goes live while requests keep flowing, none fails, none stalls."""

from __future__ import annotations

import json
import threading
import time

import pytest

from services.common.checkpoints import version_dir, write_text_atomic
from tests.integration.adapters import publish_adapter, train_reply_adapter

pytestmark = pytest.mark.integration

ASK = [{"role": "user", "content": "Where should I go?"}]
TARGETS = {1: "Go to paris.", 2: "Go to london.", 3: "Stay home."}


@pytest.fixture(scope="module")
def adapters(tiny_model):
    return {v: train_reply_adapter(tiny_model, ASK, t) for v, t in TARGETS.items()}


@pytest.fixture
def served(make_explorer, tmp_path, adapters):
    root = tmp_path / "explorer0" / "checkpoints"
    publish_adapter(adapters[1], root, "guide", 1)
    return make_explorer(), root


def _answer(ex, **kw):
    return ex.client.chat.completions.create(model="guide", messages=ASK, temperature=0, max_tokens=12, **kw)


def _wait_version(ex, version, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        models = {m["id"]: m for m in ex.http.get("/v1/models").json()["data"]}
        if models["guide"]["version"] == version:
            return models["guide"]
        time.sleep(0.05)
    raise AssertionError(f"version {version} was not loaded within {timeout}s")


def test_reload_under_concurrent_load_drops_nothing(served, adapters):
    ex, root = served
    assert _answer(ex).choices[0].message.content == TARGETS[1]
    stop, failures, done = threading.Event(), [], []

    def client_loop(k):
        while not stop.is_set():
            try:
                if k % 2:
                    r = _answer(ex)
                    done.append(r.choices[0].message.content)
                else:
                    text = "".join(c.choices[0].delta.content or "" for c in _answer(ex, stream=True) if c.choices)
                    done.append(text)
            except Exception as e:  # any failure at all is what this test is about
                failures.append(repr(e))

    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    before = len(done)
    publish_adapter(adapters[2], root, "guide", 2)
    info = _wait_version(ex, 2)
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(60)
    assert failures == []
    assert len(done) > before + 6  # traffic kept flowing through the reload
    assert set(done) <= {TARGETS[1], TARGETS[2]} and done[-1] == TARGETS[2]
    assert info["reloads"] == 2 and info["adapter"] == "guide-v2"  # v1 at start-up, then v2
    rows = ex.http.get("/experiences", params={"agent": "guide", "limit": 1000}).json()["data"]
    versions = [r["model_version"] for r in sorted(rows, key=lambda r: r["created_at"])]
    assert versions == sorted(versions) and {1, 2} <= set(versions)  # each records the version that produced it
    for r in rows:
        assert r["response"]["content"] == TARGETS[r["model_version"]]
    metrics = ex.http.get("/metrics").text
    assert 'kaizen_adapter_version{agent="guide"} 2.0' in metrics
    assert 'kaizen_adapter_reloads_total{agent="guide"} 2.0' in metrics
    assert "kaizen_adapter_reload_seconds_count 2.0" in metrics
    time.sleep(0.5)
    assert set(ex.state.engine.adapters) == {"guide-v2"}  # v1 was released once no request used it


def test_old_version_stays_loaded_while_a_request_still_uses_it(served, adapters):
    ex, root = served
    # Eight long, hot-tempered answers to another question keep this request on v1 for seconds (a
    # request holds its version until its last choice ends; one choice alone may hit EOS early).
    stream = ex.client.chat.completions.create(model="guide", messages=[{"role": "user", "content": "Tell a long story."}],
                                               temperature=2.0, max_tokens=1500, stream=True, seed=1, n=8)
    first = next(iter(stream))  # the request is running on v1
    publish_adapter(adapters[2], root, "guide", 2)
    _wait_version(ex, 2)
    # v1 stays loaded, and reported as in use (its folder must stay), until its last request ends.
    assert "guide-v1" in ex.state.engine.adapters and ex.state.registry.in_use("guide") == [1, 2]
    assert _answer(ex).choices[0].message.content == TARGETS[2]  # new requests get v2 meanwhile
    rest = list(stream)
    assert sum(1 for c in rest for ch in c.choices if ch.finish_reason in ("stop", "length")) == 8
    exp = ex.http.get(f"/experiences/{first.choices[0].model_extra['experience_id']}").json()
    assert exp["model_version"] == 1
    deadline = time.monotonic() + 10
    while ("guide-v1" in ex.state.engine.adapters or ex.state.registry.in_use("guide") != [2]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(ex.state.engine.adapters) == {"guide-v2"}
    assert ex.state.registry.in_use("guide") == [2]


def test_broken_version_is_refused_and_the_old_one_keeps_serving(served, adapters, caplog):
    ex, root = served
    broken = version_dir(root, "guide", 2)
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{}")
    (broken / "manifest.json").write_text(json.dumps({"version": 2}))
    write_text_atomic(root / "guide" / "LATEST", "2\n")
    time.sleep(1.5)
    assert _answer(ex).choices[0].message.content == TARGETS[1]
    assert {m["id"]: m["version"] for m in ex.http.get("/v1/models").json()["data"][1:]}["guide"] == 1
    assert ex.state.registry.reload_failures == 1  # reported once, not on every poll
    assert "kaizen_adapter_reload_failures 1.0" in ex.http.get("/metrics").text
    assert any("refusing version 2" in r.getMessage() for r in caplog.records)
    # a good version after it is picked up
    publish_adapter(adapters[3], root, "guide", 3)
    _wait_version(ex, 3)
    assert _answer(ex).choices[0].message.content == TARGETS[3]


def test_serving_file_tells_the_trainer_what_is_in_use(served):
    ex, root = served
    body = json.loads(next((root / "guide" / ".serving").glob("*.json")).read_text())
    assert body["versions"] == [1] and time.time() - body["updated_at"] < 30


def test_requests_pinned_to_a_version_keep_working_while_it_is_retired(served, adapters):
    """Clients pinned to `guide@v1` (the current version) keep asking while v2 and then v3 go live:
    v1 is retired under them, its last lease ends while new pinned requests arrive, and it is loaded
    again as a pinned version. Every answer must come from v1 and none may fail."""
    ex, root = served
    stop, failures, answers = threading.Event(), [], []

    def pinned():
        while not stop.is_set():
            try:
                r = ex.client.chat.completions.create(model="guide@v1", messages=ASK, temperature=0, max_tokens=12)
                answers.append(r.choices[0].message.content)
            except Exception as e:  # noqa: BLE001 - any failure is what this test is about
                failures.append(repr(e))

    threads = [threading.Thread(target=pinned) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        for version in (2, 3):
            time.sleep(1.0)
            publish_adapter(adapters[version], root, "guide", version)
            _wait_version(ex, version)
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not failures, failures[:3]
    assert answers and set(answers) == {TARGETS[1]}
    deadline = time.monotonic() + 10
    while ex.state.registry.in_use("guide") != [3] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ex.state.registry.in_use("guide") == [3] and set(ex.state.engine.adapters) == {"guide-v3"}


def test_an_episode_stays_on_the_version_its_first_call_used(served, adapters):
    """A multi-turn episode (task_id + run_id) never mixes versions: its later calls lease the
    version of its first call after a newer one went live, and that version is reported in use
    (the Trainer keeps its folder) until the episode goes idle. Other episodes get the new version;
    a call may opt out; an episode whose version was deleted moves on to the current one."""
    ex, root = served

    def turn(run_id, **meta):
        r = _answer(ex, metadata={"task_id": "trip", "run_id": run_id, **meta})
        return r.choices[0].message.content, r.system_fingerprint

    assert turn(0) == (TARGETS[1], "kaizen-guide-v1")
    publish_adapter(adapters[2], root, "guide", 2)
    _wait_version(ex, 2)
    assert turn(0) == (TARGETS[1], "kaizen-guide-v1")  # the second turn of the episode: still v1
    assert turn(1) == (TARGETS[2], "kaizen-guide-v2")  # a new episode starts on v2
    assert turn(0, episode_pin=False) == (TARGETS[2], "kaizen-guide-v2")  # opted out: current version
    assert turn(0) == (TARGETS[1], "kaizen-guide-v1")  # for that call only
    assert turn(2) == (TARGETS[2], "kaizen-guide-v2")
    publish_adapter(adapters[3], root, "guide", 3)
    _wait_version(ex, 3)
    deadline = time.monotonic() + 10
    while "guide-v2" in ex.state.engine.adapters and time.monotonic() < deadline:
        time.sleep(0.05)
    # v2 is no longer loaded, but episodes 0, 1 and 2 may still ask for it: its folder must stay.
    assert set(ex.state.engine.adapters) == {"guide-v3"} and ex.state.registry.in_use("guide") == [1, 2, 3]
    assert turn(2) == (TARGETS[2], "kaizen-guide-v2")  # loaded again for it
    # The Trainer deleted v2 anyway (another replica's view, a manual cleanup): the episode moves on.
    import shutil
    shutil.rmtree(version_dir(root, "guide", 2))
    deadline = time.monotonic() + 10
    while "guide-v2" in ex.state.engine.adapters and time.monotonic() < deadline:
        time.sleep(0.05)
    assert turn(1) == (TARGETS[3], "kaizen-guide-v3")
    assert "kaizen_episode_pin_misses 1.0" in ex.http.get("/metrics").text
    rows = ex.http.get("/experiences", params={"task_id": "trip", "limit": 100, "order": "desc"}).json()["data"]
    assert [r["model_version"] for r in rows] == [3, 2, 2, 1, 2, 2, 1, 1]  # newest first
