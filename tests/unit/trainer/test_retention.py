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
