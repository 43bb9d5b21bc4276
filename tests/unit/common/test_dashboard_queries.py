"""The dashboard's queries on a buffer filled through the services' own buffer functions, checked
against figures computed here in Python (tests/integration/common/test_dashboard_postgres.py runs
them again on PostgreSQL); its statistics; its config loading."""

from __future__ import annotations

import json
import math
import statistics
from datetime import datetime, timedelta, timezone

import pytest
import yaml

from services.common import buffer, checkpoints
from services.common.config import ConfigError
from services.common.records import Experience
from services.dashboard import queries
from services.dashboard.config import load_dashboard_config

T0 = datetime(2026, 11, 1, 12, 0, 0, tzinfo=timezone.utc)


def _exp(i: int, agent: str, version: int, reward: float | None, seconds: float) -> Experience:
    return Experience(
        experience_id=f"c{i}-0", completion_id=f"c{i}", agent=agent, model_version=version, task_id=f"t{i % 5}",
        run_id=str(i % 2), prompt_token_ids=[1, 2, 3], response_token_ids=[4, 5, 6], response_logprobs=[-0.1, -2.0, -0.01],
        messages=[{"role": "user", "content": f"question {i}"}], response={"role": "assistant", "content": "answer"},
        sampling={"temperature": 1.0}, reward=None, created_at=T0 + timedelta(seconds=seconds))


@pytest.fixture
def buffer_url(tmp_path) -> str:
    """The database under test; tests/integration/common/test_dashboard_postgres.py overrides it."""
    return f"sqlite:///{tmp_path}/b.db"


@pytest.fixture
def filled(buffer_url, tmp_path):
    """Agent a: 60 experiences over 10 minutes from versions 0-2, 50 rewarded, 40 committed, 32 of
    them trained into v1 and v2 (two steps); agent b: 5 recorded. A rejected v3 decision."""
    db = buffer.create_buffer_engine(buffer_url)
    rewards = {}
    records = []
    for i in range(60):
        records.append(_exp(i, "a", i // 20, None, seconds=i * 10))
        if i < 50:
            rewards[f"c{i}-0"] = round((i % 7) / 6, 3)
    records += [_exp(100 + i, "b", 0, None, seconds=i) for i in range(5)]
    buffer.insert_experiences(engine=db, records=records)
    for xid, r in rewards.items():
        buffer.apply_feedback(engine=db, msg_ids=[xid], reward=r, feedback={"source": "test"})
    buffer.commit_experiences(engine=db, msg_ids=[f"c{i}" for i in range(40)])
    for step, version, ids in ((1, 1, range(0, 16)), (2, 2, range(16, 32))):
        buffer.consume_batch(engine=db, agent="a", step=step, version=version,
                             consumed={f"c{i}-0": rewards[f"c{i}-0"] for i in ids}, discarded=[], state_ref=None,
                             metrics={"loss": 0.1 * step, "entropy": 1.0 / step, "clip_frac": 0.0, "tokens_per_s": 10.0,
                                      "published": True, "note": "not a figure"})
    buffer.record_decision(engine=db, agent="a", version=3, decision="rejected", serving=2, actor="gate", reason="worse")
    root = tmp_path / "checkpoints"
    for v in (1, 2):
        checkpoints.write_version(root, "a", v, lambda d: [(d / f).write_text("{}") for f in checkpoints.REQUIRED_FILES[:2]],
                                  {"parent_version": v - 1, "step": v, "experience_count": 16})
    checkpoints.set_latest(root, "a", 2)
    yield db, root, rewards
    db.dispose()


def test_overview_counts_rewards_and_buckets(filled):
    db, root, rewards = filled
    o = queries.overview(db, root, "a")
    assert o["serving"] == 2 and o["candidate"] is None
    assert o["statuses"] == {"recorded": 10, "rewarded": 10, "committed": 8, "consumed": 32, "discarded": 0}
    for v in o["versions"]:
        values = [rewards[f"c{i}-0"] for i in range(60) if i // 20 == v["version"] and f"c{i}-0" in rewards]
        assert v["experiences"] == 20 and v["reward"]["n"] == len(values)
        mean = statistics.fmean(values)
        half = 1.959964 * statistics.stdev(values) / math.sqrt(len(values))
        assert v["reward"]["mean"] == pytest.approx(mean)
        assert (v["reward"]["low"], v["reward"]["high"]) == (pytest.approx(mean - half), pytest.approx(mean + half))
        assert v["first_at"] == pytest.approx((T0 + timedelta(seconds=200 * v["version"])).timestamp())
    # 590 s of traffic: 5 s buckets (120 at most), each experience in the bucket of its second
    ot = o["over_time"]
    assert ot["bucket_s"] == 5
    assert [p["t"] for p in ot["points"]] == [int(T0.timestamp()) + 10 * i for i in range(60)]
    assert all(p["experiences"] == 1 for p in ot["points"])
    assert [p["reward"]["mean"] for p in ot["points"][:50]] == pytest.approx([rewards[f"c{i}-0"] for i in range(50)])
    assert [r["version"] for r in o["reloads"]] == [0, 1, 2]
    # a longer span: 30 s buckets, three experiences in each
    wide = queries.over_time(db, "a", T0.timestamp(), T0.timestamp() + 3600)
    assert wide["bucket_s"] == 30
    assert [(p["t"], p["experiences"]) for p in wide["points"]] == [(int(T0.timestamp()) + 30 * i, 3) for i in range(20)]
    assert [p["reward"]["n"] for p in wide["points"]] == [3] * 16 + [2] + [0] * 3


def test_trainer_and_versions_lineage(filled):
    db, root, _ = filled
    t = queries.trainer(db, "a")
    assert t["total_steps"] == 2
    assert [(s["step"], s["version"], s["consumed"], s["loss"], s["entropy"]) for s in t["steps"]] == [
        (1, 1, 16, 0.1, 1.0), (2, 2, 16, pytest.approx(0.2), 0.5)]
    assert "note" not in t["steps"][0] and t["steps"][0]["published"] is True
    v = queries.versions(db, root, "a")
    by = {x["version"]: x for x in v["versions"]}
    assert sorted(by) == [0, 1, 2, 3]
    assert (by[1]["trained_on"], by[2]["trained_on"], by[1]["parent"], by[2]["step"]) == (16, 16, 0, 2)
    assert by[1]["on_disk"] and not by[3]["on_disk"] and by[0]["served"] == 20
    assert [(d["decision"], d["actor"], d["serving"]) for d in by[3]["decisions"]] == [("rejected", "gate", 2)]
    assert queries.agents(db, root) == ["a", "b"]


def test_search_filters_and_keyset_pages(filled):
    db, _, rewards = filled
    every, before = [], None
    while True:
        page = queries.search(db, queries.ExperienceFilter(agent="a"), limit=7, before=before)
        every += [x["experience_id"] for x in page["experiences"]]
        if (before := page["next_before"]) is None:
            break
    assert every == [f"c{i}-0" for i in reversed(range(60))]
    f = queries.ExperienceFilter(agent="a", status="consumed", trained_in=2, min_reward=0.5)
    got = [x["experience_id"] for x in queries.search(db, f)["experiences"]]
    assert got == [f"c{i}-0" for i in reversed(range(16, 32)) if rewards[f"c{i}-0"] >= 0.5]
    # a key limited to agent b sees only b's, whatever else it asks
    limited = queries.search(db, queries.ExperienceFilter(agents=["b"]))["experiences"]
    assert {x["agent"] for x in limited} == {"b"} and len(limited) == 5
    assert queries.search(db, queries.ExperienceFilter(agents=["b"], agent="a"))["experiences"] == []
    x = queries.experience(db, "c3-0")
    assert x["response_logprobs"] == [-0.1, -2.0, -0.01] and x["prompt_tokens"] == 3 and x["reward"] == rewards["c3-0"]
    assert queries.experience(db, "nope") is None


def test_an_empty_agent_and_statistics():
    assert queries.mean_band(0, None, None) == {"mean": None, "low": None, "high": None, "n": 0}
    assert queries.mean_band(1, 0.5, 0.25) == {"mean": 0.5, "low": None, "high": None, "n": 1}
    b = queries.mean_band(4, 2.0, 2.0)  # 1, 1, 0, 0
    assert b["mean"] == 0.5 and b["high"] - b["mean"] == pytest.approx(1.959964 * math.sqrt(1 / 3 / 4))
    assert [queries.bucket_width(s) for s in (1, 120, 121, 3600, 86400 * 30)] == [1, 1, 2, 30, 21600]


def test_config_takes_an_explorer_or_trainer_config_and_names_an_unknown_key(tmp_path):
    explorer = {"model": {"path": "m"}, "buffer": {"url": "sqlite:///x.db"}, "checkpoints": {"root": "cp"},
                "engine": {"kind": "hf"}, "server": {"port": 8000}, "recorder": {"flush_interval_ms": 5}}
    p = tmp_path / "explorer.yaml"
    p.write_text(yaml.safe_dump(explorer))
    c = load_dashboard_config(p, ["dashboard.port=9000"])
    assert (c.buffer.url, c.checkpoints.root, c.model.path, c.dashboard.port, c.dashboard.host) == (
        "sqlite:///x.db", "cp", "m", 9000, "127.0.0.1")
    trainer = {"model": {"path": "m"}, "checkpoints": {"root": "cp", "keep_versions": 5}, "algorithm": {"name": "grpo"}}
    p.write_text(yaml.safe_dump(trainer))
    assert load_dashboard_config(p).checkpoints.root == "cp"
    p.write_text(json.dumps({"buffer": {"url": "sqlite:///x.db"}, "dashbord": {"port": 1}}))
    with pytest.raises(ConfigError, match="dashbord"):
        load_dashboard_config(p)
    with pytest.raises(ConfigError, match="dashboard.port"):
        load_dashboard_config(None, ["dashboard.port=70000"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_dashboard_config(tmp_path / "missing.yaml")


def test_the_sections_the_dashboard_skips_are_those_of_the_explorer_and_the_trainer():
    # The dashboard names them itself so that it imports neither service; this keeps the names true.
    from services.dashboard.config import OTHER_SERVICES_SECTIONS, DashboardConfig
    from services.explorer.config import ExplorerConfig
    from services.trainer.config import TrainerConfig

    theirs = (set(ExplorerConfig.model_fields) | set(TrainerConfig.model_fields)) - set(DashboardConfig.model_fields)
    assert OTHER_SERVICES_SECTIONS == theirs
