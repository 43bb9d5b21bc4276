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
