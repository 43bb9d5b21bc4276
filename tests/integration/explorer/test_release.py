"""Safe releases on a real Explorer: the gate refuses a broken candidate, a canary rolls one back
after serving only its share, a good one is promoted, a rollback by hand under load loses nothing,
and a restarted Explorer resumes a canary from the database.

The versions are real LoRA adapters on the tiny model: "good" answers the question right, "bad"
answers it wrong. The gate's suite below is the runner SDK's Environment protocol.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone

import pytest

from services.common import buffer, checkpoints
from services.common.release import EVAL_TASK_PREFIX, held_out, refused_versions, routed_to_candidate
from tests.integration.adapters import publish_adapter, train_reply_adapter

pytestmark = pytest.mark.integration

QUESTION = "What is 2+2?"
ASK = [{"role": "user", "content": QUESTION}]
RIGHT, WRONG = "4", "5"


# ---------------------------------------------------------------------------------------------
# The gate's evaluation suite (named by module:attr in the config).


class AnswerEnv:
    def __init__(self, task: int):
        self.task = task

    def reset(self) -> str:
        return QUESTION

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        return "", float((action or "").strip() == RIGHT), True, {}


async def answer(client, observation: str) -> str:
    return await client.complete(observation, temperature=0, max_tokens=4)


def tasks() -> list[int]:
    return list(range(4))


class SplitEnv(AnswerEnv):
    """Even tasks expect the right answer, odd ones the wrong one: "good" and "bad" score alike on it."""

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        return "", float((action or "").strip() == (RIGHT if self.task % 2 == 0 else WRONG)), True, {}


def split_tasks() -> list[int]:
    return list(range(8))


class TieredEnv(AnswerEnv):
    """The right answer scores on all 16 tasks, the wrong one on 14, any other on 12: each a little worse
    than the one before (not shown worse on 16 tasks), the last shown worse than the first."""

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        a = (action or "").strip()
        return "", float(a == RIGHT or (a == WRONG and self.task >= 2) or (a not in (RIGHT, WRONG) and self.task >= 4)), True, {}


def tiered_tasks() -> list[int]:
    return list(range(16))


SUITE = [
    f"release.gate.suite.env={__name__}:AnswerEnv",
    f"release.gate.suite.dataset={__name__}:tasks",
    f"release.gate.suite.agent={__name__}:answer",
    "release.poll_interval_s=0.2",
]


# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapters(tiny_model):
    return {"good": train_reply_adapter(tiny_model, ASK, RIGHT), "bad": train_reply_adapter(tiny_model, ASK, WRONG)}


@pytest.fixture(scope="module")
def mute(tiny_model):
    """A version that answers neither (an empty reply)."""
    return train_reply_adapter(tiny_model, ASK, "")


def _candidate(adapters, root, kind: str, version: int, parent: int, **manifest) -> None:
    checkpoints.write_version(root, "guide", version, lambda d: adapters[kind].save_pretrained(d),
                              {"step": version, "algorithm": "test", "parent_version": parent, **manifest})
    checkpoints.set_candidate(root, "guide", version)


def _ask(ex, task_id: str | None = None):
    extra = {"metadata": {"task_id": task_id}} if task_id else {}
    r = ex.client.chat.completions.create(model="guide", messages=ASK, temperature=0, max_tokens=4, **extra)
    return r, r.choices[0].message.content


def _decision(ex, version: int, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = ex.http.get("/versions", params={"agent": "guide"}).json()
        row = next((r for r in body["data"] if r["version"] == version), None)
        final = [d for d in (row or {}).get("decisions", []) if d["decision"] in ("promoted", "rejected", "rolled_back")]
        if final:
            return final[-1]
        time.sleep(0.2)
    raise AssertionError(f"no release decision about v{version} within {timeout}s: {body}")


def _traffic_until_served(ex, version: int, count: int, prefix: str, threads: int = 4) -> list:
    """Traffic until ``version`` has served ``count`` recorded calls; returns the failures."""
    stop, log, failures = threading.Event(), [], []
    running = _traffic(ex, stop, log, failures, prefix, threads=threads)
    deadline = time.monotonic() + 60
    while len(_served_by(ex, version)) < count:
        assert time.monotonic() < deadline and not failures, failures[:3]
        time.sleep(0.05)
    stop.set()
    for t in running:
        t.join(60)
    return failures


def _traffic(ex, stop: threading.Event, log: list, failures: list, prefix: str, threads: int = 4,
             starts: dict[str, float] | None = None) -> list[threading.Thread]:
    """Clients that ask, score the answer and send its reward, each request its own task (episode).
    ``starts``: when each task's request was sent (time.monotonic())."""
    counter = iter(range(10**9))
    lock = threading.Lock()

    def loop():
        while not stop.is_set():
            with lock:
                task = f"{prefix}-{next(counter)}"
            if starts is not None:
                starts[task] = time.monotonic()
            try:
                r, text = _ask(ex, task)
                ex.http.post("/feedback", json={"msg_ids": [r.id], "reward": float(text == RIGHT)}).raise_for_status()
                log.append((task, text))
            except Exception as e:  # any failed request is what these tests are about
                failures.append(repr(e))

    out = [threading.Thread(target=loop) for _ in range(threads)]
    for t in out:
        t.start()
    return out


def _decision_under_traffic(ex, version: int, prefix: str, *, timeout: float = 180, threads: int = 4) -> tuple[dict, list, list]:
    """Traffic (as ``_traffic``) until ``version`` is decided: (the decision, (task, answer) log, failures)."""
    stop, log, failures = threading.Event(), [], []
    running = _traffic(ex, stop, log, failures, prefix, threads=threads)
    try:
        return _decision(ex, version, timeout=timeout), log, failures
    finally:
        stop.set()
        for t in running:
            t.join(60)


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def _served_by(ex, version: int) -> list:
    """Traffic calls (not the gate's own) that ``version`` answered."""
    db = ex.state.db
    return [e for e in buffer.list_experiences(engine=db, agent="guide", limit=100_000)
            if e.model_version == version and not (e.task_id or "").startswith(EVAL_TASK_PREFIX)]


def test_gate_rejects_a_broken_candidate_and_promotes_a_good_one(make_explorer, tmp_path, adapters, tiny_model):
    root = tmp_path / "explorer0" / "checkpoints"
    publish_adapter(adapters["good"], root, "guide", 1)
    ex = make_explorer("release.mode=gated", *SUITE)
    assert _ask(ex)[1] == RIGHT  # v1 serves (and the Explorer learns its own address)

    _candidate(adapters, root, "bad", 2, parent=1)
    answers = [_ask(ex)[1] for _ in range(5)]  # users keep getting v1 while v2 is evaluated
    rejected = _decision(ex, 2)
    assert rejected["decision"] == "rejected" and rejected["by"] == "gate" and rejected["serving"] == 1
    figures = rejected["figures"]
    assert figures["mean_serving"] == 1.0 and figures["mean_candidate"] == 0.0 and figures["n_candidate"] == 4
    assert "lower bound" in rejected["reason"]
    assert set(answers) == {RIGHT} and _ask(ex)[1] == RIGHT
    assert checkpoints.read_latest(root, "guide") == 1 and checkpoints.read_candidate(root, "guide") is None
    assert _served_by(ex, 2) == []  # it never served a user
    manifest = checkpoints.validate_version(root, "guide", 2).manifest()
    assert [e["decision"] for e in manifest["release"]] == ["rejected"]

    # an adapter trained elsewhere goes through the same gate: kaizen publish --candidate
    from services.common.publish import publish_adapter as publish_checked

    adapters["good"].save_pretrained(tmp_path / "outside")
    assert publish_checked(tmp_path / "outside", agent="guide", checkpoints_root=root, base_model=str(tiny_model),
                           candidate=True).version == 3
    assert checkpoints.read_latest(root, "guide") == 1 and checkpoints.read_candidate(root, "guide") == 3
    promoted = _decision(ex, 3)
    assert promoted["decision"] == "promoted" and promoted["serving"] == 3
    assert checkpoints.read_latest(root, "guide") == 3
    deadline = time.monotonic() + 10
    while ex.http.get("/v1/models/guide").json()["version"] != 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    r, text = _ask(ex)
    assert text == RIGHT and ex.http.get(f"/experiences/{r.choices[0].model_extra['experience_id']}").json()["model_version"] == 3
    metrics = ex.http.get("/metrics").text
    assert 'kaizen_release_decisions_total{agent="guide",decision="rejected"} 1.0' in metrics
    assert 'kaizen_release_decisions_total{agent="guide",decision="promoted"} 1.0' in metrics
    listed = ex.http.get("/versions", params={"agent": "guide"}).json()
    assert listed["serving"] == 3 and [r["version"] for r in listed["data"]] == [1, 2, 3]
    assert ex.http.get("/versions", params={"agent": "nobody"}).json()["error"]["code"] == "agent_not_found"


def test_canary_rolls_back_a_worse_candidate_after_its_share_only_then_promotes_a_good_one(make_explorer, tmp_path, adapters):
    root = tmp_path / "explorer0" / "checkpoints"
    publish_adapter(adapters["good"], root, "guide", 1)
    share = 0.25
    ex = make_explorer("release.mode=canary", f"release.canary.share={share}", "release.canary.min_episodes=8",
                       "release.canary.tolerance=0.1", "release.poll_interval_s=0.2")
    assert _ask(ex)[1] == RIGHT
    _candidate(adapters, root, "bad", 2, parent=1)
    deadline = time.monotonic() + 30
    while ex.http.get("/v1/models/guide").json()["release"]["canary"] is None:
        assert time.monotonic() < deadline, "the canary did not start"
        time.sleep(0.1)

    decision, log, failures = _decision_under_traffic(ex, 2, "user", timeout=180)
    assert failures == []
    assert decision["decision"] == "rolled_back" and decision["by"] == "canary" and decision["serving"] == 1
    # Only the tasks routed to the candidate met it, and each of its users' tasks stayed on it.
    bad = _served_by(ex, 2)
    assert bad and all(routed_to_candidate("guide", e.task_id, share) for e in bad)
    decided_at = _aware(datetime.fromisoformat(decision["at"]))
    assert not any(routed_to_candidate("guide", e.task_id, share) for e in _served_by(ex, 1)
                   if e.task_id and _aware(e.created_at) < decided_at)  # after the rollback, v1 serves every task
    routed = sum(routed_to_candidate("guide", t, share) for t, _ in log)
    assert 0.1 < routed / len(log) < 0.45
    assert decision["figures"]["episodes"]["candidate"] >= 8 and decision["figures"]["upper"] < -0.1
    # what it produced is the Trainer's to discard (release.rejected_experiences), late arrivals included
    assert refused_versions(buffer.list_decisions(engine=ex.state.db, agent="guide")) == {2}
    assert checkpoints.read_latest(root, "guide") == 1
    after = [_ask(ex, f"later-{i}")[1] for i in range(20)]
    assert set(after) == {RIGHT}  # every task back on v1, the candidate's included
    metrics = ex.http.get("/metrics").text
    assert 'kaizen_canary_share{agent="guide"} 0.0' in metrics
    assert 'kaizen_release_decisions_total{agent="guide",decision="rolled_back"} 1.0' in metrics

    _candidate(adapters, root, "good", 3, parent=1)
    decision, log, failures = _decision_under_traffic(ex, 3, "user3", timeout=300)
    assert failures == []
    assert decision["decision"] == "promoted" and decision["figures"]["lower"] > -0.1
    assert checkpoints.read_latest(root, "guide") == 3


def test_rollback_by_hand_under_load_loses_no_request(make_explorer, tmp_path, adapters):
    root = tmp_path / "explorer0" / "checkpoints"
    publish_adapter(adapters["good"], root, "guide", 1)
    publish_adapter(adapters["bad"], root, "guide", 2)
    ex = make_explorer()
    assert _ask(ex)[1] == WRONG
    stop, log, failures, starts = threading.Event(), [], [], {}
    threads = _traffic(ex, stop, log, failures, "load", starts=starts)
    time.sleep(1.0)
    r = ex.http.post("/admin/rollback", json={"agent": "guide", "reason": "answers wrong"})
    answered = time.monotonic()
    time.sleep(1.5)
    stop.set()
    for t in threads:
        t.join(60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["serving"] == 1 and body["decision"]["decision"] == "rolled_back" and body["decision"]["by"] == "admin:anonymous"
    after = [text for task, text in log if starts[task] > answered]
    assert failures == [] and len(after) > 4
    # requests sent after the answer get v1 (those already running when it came may still get v2: log order is the
    # order they finished in, which a slow one can trail by more than the 4 clients' worth)
    assert set(after) == {RIGHT}
    assert checkpoints.read_latest(root, "guide") == 1
    again = ex.http.post("/admin/rollback", json={"agent": "guide", "to": 1})
    assert again.status_code == 409 and "already serves v1" in again.json()["error"]["message"]
    missing = ex.http.post("/admin/rollback", json={"agent": "guide", "to": 9})
    assert missing.status_code == 404 and str(root) not in missing.text
    assert ex.http.post("/admin/rollback", json={"agent": "nobody"}).status_code == 404
    assert ex.http.post("/admin/rollback", json={"agent": "guide", "to": -1}).status_code == 400


def test_kaizen_rollback_command(tmp_path, adapters):
    from services.cli import main

    root, url = tmp_path / "ckpt", f"sqlite:///{tmp_path}/buffer.db"
    publish_adapter(adapters["good"], root, "guide", 1)
    publish_adapter(adapters["bad"], root, "guide", 2)
    args = ["rollback", "--agent", "guide", "--checkpoints-root", str(root), "--buffer-url", url]
    assert main([*args, "--to", "v9"]) == 2 and checkpoints.read_latest(root, "guide") == 2
    assert main(args) == 0 and checkpoints.read_latest(root, "guide") == 1
    db = buffer.create_buffer_engine(url)
    [d] = buffer.list_decisions(engine=db, agent="guide")
    assert (d.decision, d.version, d.serving, d.actor) == ("rolled_back", 2, 1, "cli")
    [a] = buffer.list_audit(engine=db)  # the refused --to v9 left none
    assert (a["actor"], a["action"], a["target"]) == ("cli", "rollback", {"agent": "guide", "to": None})
    assert checkpoints.validate_version(root, "guide", 2).manifest()["release"][0]["decision"] == "rolled_back"
    assert main([*args, "--to", "0"]) == 0 and checkpoints.read_latest(root, "guide") == 0


def test_restarted_explorer_resumes_the_canary_from_the_database(make_explorer, tmp_path, adapters):
    root = tmp_path / "shared" / "checkpoints"
    same = [f"buffer.url=sqlite:///{tmp_path}/shared/buffer.db", f"checkpoints.root={root}"]
    publish_adapter(adapters["good"], root, "guide", 1)
    canary = ["release.mode=canary", "release.canary.share=0.5", "release.canary.min_episodes=12",
              "release.canary.tolerance=0.1", "release.poll_interval_s=0.2", *same]
    ex1 = make_explorer(*canary)
    assert _ask(ex1)[1] == RIGHT
    _candidate(adapters, root, "bad", 2, parent=1)
    deadline = time.monotonic() + 30
    while ex1.http.get("/v1/models/guide").json()["release"]["canary"] is None:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert _traffic_until_served(ex1, 2, 5, "before", threads=2) == []
    assert len(_served_by(ex1, 2)) < 12
    ex1.stop()

    ex2 = make_explorer(*canary)
    decision, log, failures = _decision_under_traffic(ex2, 2, "after", timeout=180, threads=2)
    assert failures == [] and decision["decision"] == "rolled_back"
    started = [d for d in buffer.list_decisions(engine=ex2.state.db, agent="guide") if d.decision == "canary_started"]
    assert len(started) == 1  # the restarted Explorer continued the recorded canary, not a new one
    assert decision["figures"]["episodes"]["candidate"] >= 12
    assert len([e for e in _served_by(ex2, 2) if e.task_id.startswith("after")]) < decision["figures"]["episodes"]["candidate"]


def test_guard_raises_an_alarm_and_rolls_back_a_worse_version_in_immediate_mode(make_explorer, tmp_path, adapters):
    root = tmp_path / "explorer0" / "checkpoints"
    publish_adapter(adapters["good"], root, "guide", 1)
    ex = make_explorer("release.guard.min_episodes=10", "release.guard.margin=0.1", "release.guard.rollback=true",
                       "release.guard.check_interval_s=1",
                       "release.poll_interval_s=0.2")
    assert _traffic_until_served(ex, 1, 12, "v1") == []
    checkpoints.publish_version(root, "guide", 2, lambda d: adapters["bad"].save_pretrained(d),
                                {"step": 2, "algorithm": "test", "parent_version": 1})  # immediate: it serves at once
    decision, log, failures = _decision_under_traffic(ex, 2, "v2", timeout=120)
    assert failures == []
    assert decision["decision"] == "rolled_back" and decision["by"] == "guard" and decision["serving"] == 1
    kinds = [d["decision"] for d in ex.http.get("/versions", params={"agent": "guide"}).json()["data"][1]["decisions"]]
    assert kinds == ["alarm", "rolled_back"]
    assert checkpoints.read_latest(root, "guide") == 1
    assert 'kaizen_release_decisions_total{agent="guide",decision="alarm"} 1.0' in ex.http.get("/metrics").text
    # The decision is recorded before this replica has loaded v1 again (immediate mode retired it when v2
    # came): /v1/models says what it serves, and from then on every new task gets v1.
    deadline = time.monotonic() + 30
    while ex.http.get("/v1/models/guide").json()["version"] != 1:
        assert time.monotonic() < deadline, "v1 was not loaded again within 30 s of the rollback"
        time.sleep(0.05)
    assert {_ask(ex, f"after-{i}")[1] for i in range(5)} == {RIGHT}


def test_gate_on_a_replay_of_held_out_traffic(make_explorer, tmp_path, adapters):
    """No suite: the gate replays held-out rewarded calls (their recorded messages) on both versions
    and scores the answers with the application's reward and the `expected` its feedback carried."""
    root = tmp_path / "explorer0" / "checkpoints"
    publish_adapter(adapters["good"], root, "guide", 1)
    ex = make_explorer("release.mode=gated", "release.gate.replay.holdout_share=0.5",
                       "release.gate.replay.reward=runner_sdk.rewards:ExactMatch", "release.gate.replay.items=8",
                       "release.poll_interval_s=0.2")
    for i in range(24):  # 11 of these tasks hash into the held-out half
        r, text = _ask(ex, f"user-{i}")
        ex.http.post("/feedback", json={"msg_ids": [r.id], "reward": float(text == RIGHT), "expected": RIGHT}).raise_for_status()
    held = [f"user-{i}" for i in range(24) if held_out("guide", f"user-{i}", 0.5)]
    assert len(held) >= 8

    _candidate(adapters, root, "bad", 2, parent=1)
    rejected = _decision(ex, 2)
    assert rejected["decision"] == "rejected" and rejected["figures"]["eval"] == "replay"
    replayed = rejected["figures"]["items"]
    assert len(replayed) == 8
    tasks = {ex.http.get(f"/experiences/{i}").json()["task_id"] for i in replayed}
    assert tasks <= set(held)  # only held-out traffic, which the Trainer never trains on
    assert rejected["figures"]["mean_serving"] == 1.0 and rejected["figures"]["mean_candidate"] == 0.0

    _candidate(adapters, root, "good", 3, parent=1)
    assert _decision(ex, 3)["decision"] == "promoted"


def _serving(ex, version: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while ex.http.get("/v1/models/guide").json()["version"] != version:
        assert time.monotonic() < deadline, f"v{version} did not serve within {timeout}s"
        time.sleep(0.05)


def test_gate_every_third_version_rolls_back_to_the_last_one_it_measured(make_explorer, tmp_path, adapters, tiny_model):
    """release.gate.every=3: two versions serve unmeasured, the third is measured against the version the
    gate last measured; a worse one rolls every version since back to it (their traffic refused), and the
    next block, trained from it again, is measured against it with its scores kept from the first time."""
    root = tmp_path / "explorer0" / "checkpoints"
    publish_adapter(adapters["good"], root, "guide", 1)
    ex = make_explorer("release.mode=gated", "release.gate.every=3", *SUITE)
    assert _ask(ex)[1] == RIGHT

    for v, at in ((2, 1), (3, 2)):  # a Trainer's candidates, each trained from the one serving
        _candidate(adapters, root, "bad", v, parent=v - 1)
        d = _decision(ex, v)
        assert (d["decision"], d["serving"], d["by"]) == ("promoted", v, "gate") and "serves unmeasured" in d["reason"]
        assert d["figures"] == {"between_gates": True, "anchor": 1, "position": at, "every": 3}
        _serving(ex, v)
    assert _ask(ex, "between")[1] == WRONG  # users met the unmeasured versions: what every=3 trades for speed

    _candidate(adapters, root, "bad", 4, parent=3)
    rejected = _decision(ex, 4)
    assert (rejected["decision"], rejected["serving"]) == ("rejected", 1)
    figures = rejected["figures"]
    assert (figures["anchor"], figures["served_since"], figures["every"]) == (1, [3, 2], 3)
    assert (figures["mean_serving"], figures["mean_candidate"]) == (1.0, 0.0) and "vs v1 1.000" in rejected["reason"]
    back = [d for d in ex.http.get("/versions", params={"agent": "guide"}).json()["data"][2]["decisions"]
            if d["decision"] == "rolled_back"]
    assert len(back) == 1 and (back[0]["serving"], back[0]["figures"]["refused"]) == (1, [3, 2])
    assert checkpoints.read_latest(root, "guide") == 1 and checkpoints.read_candidate(root, "guide") is None
    _serving(ex, 1)
    assert {_ask(ex, f"after-{i}")[1] for i in range(3)} == {RIGHT}
    assert refused_versions(buffer.list_decisions(engine=ex.state.db, agent="guide", limit=100)) == {2, 3, 4}

    # the Trainer goes on from v1: the next block, measured against v1 again
    for v in (5, 6):
        _candidate(adapters, root, "good", v, parent=1 if v == 5 else v - 1)
        assert _decision(ex, v)["figures"]["anchor"] == 1
    _candidate(adapters, root, "good", 7, parent=6)
    promoted = _decision(ex, 7)
    assert (promoted["decision"], promoted["serving"], promoted["figures"]["anchor"]) == ("promoted", 7, 1)
    assert promoted["figures"]["served_since"] == [6, 5]
    v1_scored = {e.task_id for e in buffer.list_experiences(engine=ex.state.db, agent="guide", limit=100_000)
                 if "/serving-v1" in (e.task_id or "")}
    assert len(v1_scored) == 4, v1_scored  # v1 scored once (4 tasks), for both measurements against it
    _candidate(adapters, root, "good", 8, parent=7)  # the measured v7 anchors the next block
    assert _decision(ex, 8)["figures"] == {"between_gates": True, "anchor": 7, "position": 1, "every": 3}

    # a candidate of `kaizen publish` is measured against the one serving at once, whatever its place
    from services.common.publish import publish_adapter as publish_checked

    _serving(ex, 8)
    adapters["bad"].save_pretrained(tmp_path / "outside")
    v = publish_checked(tmp_path / "outside", agent="guide", checkpoints_root=root, base_model=str(tiny_model),
                        candidate=True).version
    outside = _decision(ex, v)
    assert (outside["decision"], outside["serving"]) == ("rejected", 8) and "anchor" not in outside["figures"]


def test_gate_every_measures_a_trainers_cold_start_once_at_its_end(make_explorer, tmp_path, adapters):
    """A Trainer's cold start (its manifests' ``cold_start``) is one block whatever release.gate.every: its versions
    serve unmeasured past every's count, its last is measured against the version it began from, and the next
    block counts from that one."""
    root = tmp_path / "explorer0" / "checkpoints"
    publish_adapter(adapters["good"], root, "guide", 1)
    ex = make_explorer("release.mode=gated", "release.gate.every=2", *SUITE)
    assert _ask(ex)[1] == RIGHT
    for v in (2, 3):  # v3 would be measured at every=2; inside the cold start it serves unmeasured
        _candidate(adapters, root, "bad", v, parent=v - 1, cold_start={"steps": 3, "last": False})
        d = _decision(ex, v)
        assert (d["decision"], d["serving"]) == ("promoted", v) and f"version {v - 1} of the Trainer's cold start (3 steps" in d["reason"]
        assert d["figures"] == {"between_gates": True, "anchor": 1, "position": v - 1, "every": 2, "cold_start": 3}
        _serving(ex, v)
    _candidate(adapters, root, "good", 4, parent=3, cold_start={"steps": 3, "last": True})
    measured = _decision(ex, 4)
    assert (measured["decision"], measured["serving"], measured["by"]) == ("promoted", 4, "gate")
    assert (measured["figures"]["anchor"], measured["figures"]["served_since"]) == (1, [3, 2])
    assert "vs v1" in measured["reason"]
    _candidate(adapters, root, "good", 5, parent=4)  # the loop's first version: 1 of 2 after the measured v4
    assert _decision(ex, 5)["figures"] == {"between_gates": True, "anchor": 4, "position": 1, "every": 2}


def test_gate_rule_no_harm_promotes_a_different_version_and_rejects_one_shown_worse(make_explorer, tmp_path, adapters,
                                                                                   mute):
    """release.gate.rule=no_harm turns the burden of proof: on a suite where "good" and "bad" each answer
    half the tasks, "bad" differs from the serving "good" on every task without being worse, which the
    default rule (non-inferiority) refuses and no_harm promotes; a version that answers nothing is shown
    worse than "bad" (it fails the 4 tasks "bad" answers) and is rejected."""
    root = tmp_path / "explorer0" / "checkpoints"
    publish_adapter(adapters["good"], root, "guide", 1)
    split = [f"release.gate.suite.env={__name__}:SplitEnv", f"release.gate.suite.dataset={__name__}:split_tasks",
             *SUITE[2:], "release.gate.tolerance=0"]
    ex = make_explorer("release.mode=gated", "release.gate.rule=no_harm", *split)
    assert _ask(ex)[1] == RIGHT

    _candidate(adapters, root, "bad", 2, parent=1)
    promoted = _decision(ex, 2)
    figures = promoted["figures"]
    assert (promoted["decision"], promoted["serving"], figures["rule"]) == ("promoted", 2, "no_harm")
    assert (figures["mean_serving"], figures["mean_candidate"], figures["diff"]) == (0.5, 0.5, 0.0)
    assert figures["lower"] < -0.5 < 0.5 < figures["upper"]  # non-inferiority's bound: it would have refused it
    scores = figures["scores"]  # per gate task, in the suite's order: equal means, different tasks solved
    assert len(scores["against"]) == len(scores["candidate"]) == figures["n_candidate"]
    assert (sum(scores["against"]), sum(scores["candidate"])) == (0.5 * figures["n_candidate"],) * 2
    assert scores["against"] != scores["candidate"]
    assert "upper bound" in promoted["reason"] and "rule no_harm" in promoted["reason"]

    _candidate({"mute": mute}, root, "mute", 3, parent=2)
    rejected = _decision(ex, 3)
    figures = rejected["figures"]
    assert (rejected["decision"], rejected["serving"]) == ("rejected", 2)
    assert (figures["mean_serving"], figures["mean_candidate"]) == (0.5, 0.0) and figures["upper"] < 0
    assert checkpoints.read_latest(root, "guide") == 2 and _served_by(ex, 3) == []


def test_gate_against_best_stops_a_walk_down_in_steps_too_small_to_show(make_explorer, tmp_path, adapters, mute):
    """release.gate.against=best under no_harm: "bad" is a little worse than the serving "good" (14 of 16 tasks
    against 16, not shown worse) and is promoted, "good" staying the best measured; the mute version is as
    little worse than "bad" (12 against 14), which against=last would promote, but it is measured against
    "good" and shown worse: rejected, and "bad", which served since, rolled back to "good"."""
    from services.common.release import gate_verdict, paired_lower_bound

    root = tmp_path / "explorer0" / "checkpoints"
    publish_adapter(adapters["good"], root, "guide", 1)
    tiered = [f"release.gate.suite.env={__name__}:TieredEnv", f"release.gate.suite.dataset={__name__}:tiered_tasks",
              *SUITE[2:], "release.gate.tolerance=0", "release.gate.rule=no_harm", "release.gate.against=best"]
    ex = make_explorer("release.mode=gated", *tiered)
    assert _ask(ex)[1] == RIGHT

    _candidate(adapters, root, "bad", 2, parent=1)
    promoted = _decision(ex, 2)
    figures = promoted["figures"]
    assert (promoted["decision"], promoted["serving"]) == ("promoted", 2)
    assert (figures["mean_serving"], figures["mean_candidate"], figures["against"], figures["best"]) == (1.0, 0.875, "best", 1)
    assert figures["upper"] >= 0 and "(the best measured)" in promoted["reason"]
    _serving(ex, 2)

    bad, silent = [0.0] * 2 + [1.0] * 14, [0.0] * 4 + [1.0] * 12
    assert gate_verdict(paired_lower_bound(bad, silent, confidence=0.95), rule="no_harm", tolerance=0)[0]  # last: promoted
    _candidate({"mute": mute}, root, "mute", 3, parent=2)
    rejected = _decision(ex, 3)
    figures = rejected["figures"]
    assert (rejected["decision"], rejected["serving"]) == ("rejected", 1)
    assert (figures["mean_serving"], figures["mean_candidate"], figures["best"]) == (1.0, 0.75, 1) and figures["upper"] < 0
    assert "vs v1 (the best measured)" in rejected["reason"]
    back = [d for d in buffer.list_decisions(engine=ex.state.db, agent="guide") if d.decision == "rolled_back"]
    assert len(back) == 1 and (back[0].version, back[0].serving, back[0].figures["refused"]) == (2, 1, [2])
    assert checkpoints.read_latest(root, "guide") == 1 and _served_by(ex, 3) == []
    _serving(ex, 1)
    assert refused_versions(buffer.list_decisions(engine=ex.state.db, agent="guide", limit=100)) == {2, 3}

    _candidate(adapters, root, "good", 4, parent=1)  # trained on from v1: as good, so the newer becomes the best
    again = _decision(ex, 4)
    assert (again["decision"], again["figures"]["mean_serving"], again["figures"]["best"]) == ("promoted", 1.0, 4)
    v1_scored = {e.task_id for e in buffer.list_experiences(engine=ex.state.db, agent="guide", limit=100_000)
                 if "/serving-v1" in (e.task_id or "")}
    assert len(v1_scored) == 16, len(v1_scored)  # v1 scored once, for all three measurements against it
