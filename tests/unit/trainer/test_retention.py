"""Old versions are deleted only when kept count, grace period and serving replicas all allow it."""

from __future__ import annotations

import json
import time

from services.common import checkpoints as ck
from services.trainer.retention import versions_to_delete


def _publish(root, n):
    for v in range(1, n + 1):
        ck.publish_version(root, "a", v, lambda d: ((d / "adapter_config.json").write_text("{}"),
                                                     (d / "adapter_model.safetensors").write_bytes(b"x")), {})


def test_keep_grace_and_serving(tmp_path):
    _publish(tmp_path, 5)
    now = time.time()
    assert versions_to_delete(tmp_path, "a", keep=2, grace_s=60, now=now) == []  # successors too young
    assert versions_to_delete(tmp_path, "a", keep=2, grace_s=60, now=now + 61) == [1, 2, 3]
    serving = tmp_path / "a" / ".serving"
    serving.mkdir()
    (serving / "r1.json").write_text(json.dumps({"versions": [2], "updated_at": now + 60}))
    (serving / "dead.json").write_text(json.dumps({"versions": [1], "updated_at": now - 3600}))
    assert versions_to_delete(tmp_path, "a", keep=2, grace_s=60, now=now + 61) == [1, 3]


def test_the_gates_anchor_and_the_versions_served_since_are_kept(tmp_path):
    """release.gate.every: a rejection rolls back to the version the gate last measured, however old."""
    promoted = lambda between: {"decision": "promoted", "by": "gate", "figures": {"between_gates": between}}  # noqa: E731
    for v, parent, between in ((1, 0, False), (2, 1, True), (3, 2, False), (4, 3, True), (5, 3, True), (6, 5, True),
                               (7, 6, False), (8, 3, True), (9, 8, True)):
        ck.publish_version(root := tmp_path, "a", v, lambda d: ((d / "adapter_config.json").write_text("{}"),
                                                                 (d / "adapter_model.safetensors").write_bytes(b"x")),
                           {"parent_version": parent})
        ck.record_release(root, "a", v, promoted(between))
    ck.set_latest(tmp_path, "a", 9)  # v9 and v8 served since v3, the anchor (v4-v7 a block rolled back)
    assert versions_to_delete(tmp_path, "a", keep=1, grace_s=0, now=time.time() + 1) == [1, 2, 4, 5, 6, 7]


def test_the_best_version_the_gate_measured_is_kept(tmp_path):
    """release.gate.against=best: a rejection rolls back to the best measured version, older than the anchor."""
    entries = {1: {"decision": "promoted", "by": "gate", "figures": {"best": 1}},
               2: {"decision": "promoted", "by": "gate", "figures": {"between_gates": True}},
               3: {"decision": "promoted", "by": "gate", "figures": {"best": 1}},
               4: {"decision": "promoted", "by": "gate", "figures": {"between_gates": True}}}
    for v, entry in entries.items():
        ck.publish_version(tmp_path, "a", v, lambda d: ((d / "adapter_config.json").write_text("{}"),
                                                         (d / "adapter_model.safetensors").write_bytes(b"x")),
                           {"parent_version": v - 1})
        ck.record_release(tmp_path, "a", v, {"id": v, **entry})
    ck.set_latest(tmp_path, "a", 4)
    assert versions_to_delete(tmp_path, "a", keep=1, grace_s=0, now=time.time() + 1) == [2]
