"""Checkpoint layout: atomic publication, immutability, LATEST, validation."""

from __future__ import annotations

import json

import pytest

from services.common import checkpoints as ck


def _writer(d):
    (d / "adapter_config.json").write_text("{}")
    (d / "adapter_model.safetensors").write_bytes(b"x")


def test_publish_then_discover(tmp_path):
    v = ck.publish_version(tmp_path, "agent", 1, _writer, {"step": 3})
    assert v.path == tmp_path / "agent" / "v1"
    assert ck.read_latest(tmp_path, "agent") == 1
    assert v.manifest()["step"] == 3 and v.manifest()["version"] == 1
    ck.publish_version(tmp_path, "agent", 2, _writer, {})
    assert ck.read_latest(tmp_path, "agent") == 2
    assert ck.list_versions(tmp_path, "agent") == [1, 2]
    assert ck.list_agents(tmp_path) == ["agent"]
    assert not [p for p in (tmp_path / "agent").iterdir() if p.name.startswith(".tmp")]


def test_versions_are_immutable(tmp_path):
    ck.publish_version(tmp_path, "a", 1, _writer, {})
    with pytest.raises(ck.CheckpointError, match="immutable"):
        ck.publish_version(tmp_path, "a", 1, _writer, {})


def test_failed_writer_leaves_nothing(tmp_path):
    def broken(d):
        (d / "adapter_config.json").write_text("{}")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        ck.publish_version(tmp_path, "a", 1, broken, {})
    assert ck.list_versions(tmp_path, "a") == [] and ck.read_latest(tmp_path, "a") is None
    assert list((tmp_path / "a").iterdir()) == []


def test_validate_names_what_is_missing(tmp_path):
    d = tmp_path / "a" / "v3"
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text("{}")
    with pytest.raises(ck.CheckpointError, match="adapter_model.safetensors, manifest.json"):
        ck.validate_version(tmp_path, "a", 3)
    _writer(d)
    (d / "manifest.json").write_text(json.dumps({"version": 4}))
    with pytest.raises(ck.CheckpointError, match="says version 4"):
        ck.validate_version(tmp_path, "a", 3)


def test_latest_garbage_and_bad_agent_names(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "LATEST").write_text("banana")
    with pytest.raises(ck.CheckpointError, match="not a version"):
        ck.read_latest(tmp_path, "a")
    with pytest.raises(ck.CheckpointError, match="invalid agent name"):
        ck.agent_dir(tmp_path, "../etc")


def test_delete_refuses_latest(tmp_path):
    ck.publish_version(tmp_path, "a", 1, _writer, {})
    ck.publish_version(tmp_path, "a", 2, _writer, {})
    with pytest.raises(ck.CheckpointError):
        ck.delete_version(tmp_path, "a", 2)
    ck.delete_version(tmp_path, "a", 1)
    assert ck.list_versions(tmp_path, "a") == [2]


# Repair after a kill: what a restarted Trainer finds half done, and how it finishes or undoes it.


def test_write_version_leaves_latest_to_set_latest(tmp_path):
    ck.publish_version(tmp_path, "a", 1, _writer, {})
    ck.write_version(tmp_path, "a", 2, _writer, {"step": 4})
    assert ck.read_latest(tmp_path, "a") == 1 and ck.validate_version(tmp_path, "a", 2).manifest()["step"] == 4
    ck.set_latest(tmp_path, "a", 2)
    assert ck.read_latest(tmp_path, "a") == 2


def test_read_latest_without_fallback_tells_a_missing_latest(tmp_path):
    ck.write_version(tmp_path, "a", 1, _writer, {})
    assert ck.read_latest(tmp_path, "a") == 1  # readers: the newest version dir
    assert ck.read_latest(tmp_path, "a", fallback=False) is None  # writers: LATEST was never written


def test_finish_publication_points_latest_at_a_complete_version(tmp_path):
    ck.publish_version(tmp_path, "a", 1, _writer, {})
    ck.write_version(tmp_path, "a", 2, _writer, {})  # killed here: v2 in place, LATEST still 1
    done = ck.finish_publication(tmp_path, "a", 2)
    assert done is not None and done.version == 2 and ck.read_latest(tmp_path, "a", fallback=False) == 2
    assert ck.finish_publication(tmp_path, "a", 2).version == 2  # idempotent
    assert ck.finish_publication(tmp_path, "a", 3) is None  # nothing written yet: publish afresh


def test_finish_publication_of_a_first_version_writes_latest(tmp_path):
    ck.write_version(tmp_path, "a", 1, _writer, {})
    assert ck.finish_publication(tmp_path, "a", 1).version == 1
    assert (tmp_path / "a" / "LATEST").read_text() == "1\n"


def test_finish_publication_never_moves_latest_backwards(tmp_path):
    ck.write_version(tmp_path, "a", 1, _writer, {})
    ck.publish_version(tmp_path, "a", 2, _writer, {})
    assert ck.finish_publication(tmp_path, "a", 1).version == 1
    assert ck.read_latest(tmp_path, "a", fallback=False) == 2


def test_finish_publication_sets_an_invalid_version_aside(tmp_path):
    ck.publish_version(tmp_path, "a", 1, _writer, {})
    (tmp_path / "a" / "v2").mkdir()  # not something write_version leaves: no manifest, no adapter
    assert ck.finish_publication(tmp_path, "a", 2) is None
    assert ck.list_versions(tmp_path, "a") == [1] and ck.read_latest(tmp_path, "a") == 1
    assert [p.name.split("-")[0] for p in (tmp_path / "a").iterdir() if p.name.startswith(".invalid")] == [".invalid"]
    ck.publish_version(tmp_path, "a", 2, _writer, {})  # the version can be written now
    assert ck.read_latest(tmp_path, "a") == 2


def _state(root, agent, step):
    d = ck.state_path(root, agent, step)
    d.mkdir(parents=True)
    (d / "trainer.json").write_text(json.dumps({"step": step}))
    return d


def test_states_listed_and_dropped_after_the_committed_step(tmp_path):
    for step in (0, 1, 2, 3):
        _state(tmp_path, "a", step)
    assert ck.state_path(tmp_path, "a", 3).name == "step-00000003"
    assert ck.list_states(tmp_path, "a") == [0, 1, 2, 3]
    assert ck.drop_states_after(tmp_path, "a", step=1) == [2, 3]
    assert ck.list_states(tmp_path, "a") == [0, 1]
    assert sorted(p.name for p in ck.state_dir(tmp_path, "a").iterdir()) == ["step-00000000", "step-00000001"]
    assert ck.drop_states_after(tmp_path, "a", step=1) == []
    assert ck.list_states(tmp_path, "nobody") == [] and ck.drop_states_after(tmp_path, "nobody", step=0) == []


def test_remove_temporaries_of_interrupted_writes(tmp_path):
    ck.publish_version(tmp_path, "a", 1, _writer, {})
    _state(tmp_path, "a", 1)
    agent, states = tmp_path / "a", ck.state_dir(tmp_path, "a")
    leftovers = [agent / ".tmp-v2-x1", states / ".tmp-step-00000002-x2", agent / ".deleting-v0-7", states / ".deleting-step-00000000-7"]
    for d in leftovers:
        d.mkdir()
        (d / "adapter_model.safetensors").write_bytes(b"half")
    (agent / ".LATEST.abc").write_text("2")
    (agent / ".serving").mkdir()  # the Explorer's, never touched
    removed = ck.remove_temporaries(tmp_path, "a")
    assert sorted(p.name for p in removed) == sorted([*(d.name for d in leftovers), ".LATEST.abc"])
    assert sorted(p.name for p in agent.iterdir()) == [".serving", "LATEST", "state", "v1"]
    assert [p.name for p in states.iterdir()] == ["step-00000001"]
    assert ck.remove_temporaries(tmp_path, "a") == [] and ck.remove_temporaries(tmp_path, "nobody") == []


def test_trained_agents_include_those_not_published_yet(tmp_path):
    ck.publish_version(tmp_path, "published", 1, _writer, {})
    _state(tmp_path, "published", 2)
    _state(tmp_path, "unpublished", 1)
    assert ck.list_trained_agents(tmp_path) == ["published", "unpublished"]
    assert ck.list_agents(tmp_path) == ["published"]
    assert ck.list_trained_agents(tmp_path / "missing") == []
