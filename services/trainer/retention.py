"""Which old adapter versions may be deleted: never the newest ``keep``, never one an Explorer
replica reports in use, and never before ``grace_s`` has passed since its successor appeared."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from services.common import checkpoints

log = logging.getLogger(__name__)

SERVING_STALE_S = 120.0  # a replica that has not refreshed its serving file for this long is gone


def versions_in_use(root: str | Path, agent: str, *, now: float | None = None) -> set[int]:
    """Versions live Explorer replicas still read (from <root>/<agent>/.serving/*.json)."""
    now = time.time() if now is None else now
    used: set[int] = set()
    d = Path(root) / agent / ".serving"
    if not d.is_dir():
        return used
    for f in d.glob("*.json"):
        try:
            body = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if now - float(body.get("updated_at", 0)) <= SERVING_STALE_S:
            used.update(int(v) for v in body.get("versions", []))
    return used


def versions_to_delete(root: str | Path, agent: str, *, keep: int, grace_s: float, now: float | None = None) -> list[int]:
    now = time.time() if now is None else now
    versions = checkpoints.list_versions(root, agent)
    latest = checkpoints.read_latest(root, agent)
    in_use = versions_in_use(root, agent, now=now)
    doomed = []
    for i, v in enumerate(versions[:-keep] if keep else versions):
        if v == latest or v in in_use:
            continue
        successor = checkpoints.version_dir(root, agent, versions[i + 1]) / "manifest.json"
        try:
            born = float(json.loads(successor.read_text()).get("created_at", 0))
        except (OSError, ValueError):
            born = successor.stat().st_mtime if successor.exists() else now
        if now - born >= grace_s:
            doomed.append(v)
    return doomed


def prune_versions(root: str | Path, agent: str, *, keep: int, grace_s: float) -> list[int]:
    deleted = []
    for v in versions_to_delete(root, agent, keep=keep, grace_s=grace_s):
        try:
            checkpoints.delete_version(root, agent, v)
            deleted.append(v)
        except (OSError, checkpoints.CheckpointError) as e:
            log.warning("could not delete %s v%d: %s", agent, v, e)
    if deleted:
        log.info("agent %s: deleted old versions %s", agent, deleted)
    return deleted
