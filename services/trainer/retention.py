"""Which old adapter versions may be deleted: never the newest ``keep``, never one an Explorer
replica reports in use, never the serving version's block (release.gate.every: the version the gate
last measured, which a rejection rolls back to, and those that served since), never the best version
the gate has measured (release.gate.against=best: a rejection rolls back to it), and never before
``grace_s`` has passed since its successor appeared."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from services.common import checkpoints
from services.common.release import gate_best, gate_block

log = logging.getLogger(__name__)

def versions_to_delete(root: str | Path, agent: str, *, keep: int, grace_s: float, now: float | None = None) -> list[int]:
    now = time.time() if now is None else now
    versions = checkpoints.list_versions(root, agent)
    latest = checkpoints.read_latest(root, agent)
    in_use = checkpoints.versions_in_use(root, agent, now=now)
    if latest:
        anchor, served = gate_block(root, agent, latest)
        in_use |= {anchor, *served, gate_best(root, agent, anchor)[0]}
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
