"""The checkpoint layout the Trainer publishes and the Explorer loads.

    <root>/<agent>/v<N>/      a complete PEFT adapter dir + manifest.json (immutable once there)
    <root>/<agent>/LATEST     the version that serves (replaced by write-temp-and-rename)
    <root>/<agent>/CANDIDATE  a published version awaiting its release decision (release.mode gated or
                              canary); removed once the decision is carried out
    <root>/<agent>/state/step-<8 digits>/     what a restarted Trainer needs to resume
    <root>/<agent>/.publish.lock   flock'd by whoever numbers and publishes a version (the Trainer
                                   for each step, ``kaizen publish`` for an adapter trained elsewhere)
    <root>/<agent>/.release.lock   flock'd by whoever decides what serves (one Explorer replica's
                                   release controller at a time, ``kaizen rollback``)

A version is written under a temporary name, fsynced and renamed into place, so a reader never
sees half a version. A version's adapter files are never rewritten (vLLM caches adapters by name and
path); its manifest.json gains release decisions (``record_release``), replaced atomically.

A writer killed half way leaves temporaries (``.tmp-*``, ``.LATEST.*``, ``.deleting-*``), or a
complete ``v<N>`` that LATEST does not name yet; ``remove_temporaries`` and ``finish_publication``
let a restarted Trainer repair both instead of tripping over them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from services.common.faults import failpoint

AGENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_VERSION_DIR = re.compile(r"^v(\d+)$")
_STATE_DIR = re.compile(r"^step-(\d+)$")
# What the atomic writers below leave behind when killed mid-write (never a reader-visible name).
_TEMPORARY = re.compile(r"^\.(tmp-|LATEST\.|CANDIDATE\.|deleting-)")
REQUIRED_FILES = ("adapter_config.json", "adapter_model.safetensors", "manifest.json")
PUBLISH_LOCK = ".publish.lock"  # a lasting part of the layout, not a temporary
RELEASE_LOCK = ".release.lock"


class CheckpointError(RuntimeError):
    """A version that cannot be published or loaded."""


@dataclass(frozen=True)
class AdapterVersion:
    agent: str
    version: int
    path: Path

    def manifest(self) -> dict[str, Any]:
        return json.loads((self.path / "manifest.json").read_text())


def check_agent_name(agent: str) -> str:
    if not AGENT_NAME.match(agent):
        raise CheckpointError(
            f"invalid agent name {agent!r}: use letters, digits, '.', '_' and '-' (at most 128)"
        )
    return agent


def agent_dir(root: str | Path, agent: str) -> Path:
    return Path(root) / check_agent_name(agent)


def version_dir(root: str | Path, agent: str, version: int) -> Path:
    return agent_dir(root, agent) / f"v{version}"


def state_dir(root: str | Path, agent: str) -> Path:
    return agent_dir(root, agent) / "state"


def state_path(root: str | Path, agent: str, step: int) -> Path:
    """Where the Trainer state after ``step`` lives (the database's ``state_ref`` points here)."""
    return state_dir(root, agent) / f"step-{step:08d}"


def list_states(root: str | Path, agent: str) -> list[int]:
    """Steps that have a saved trainer state, oldest first."""
    d = state_dir(root, agent)
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := _STATE_DIR.match(p.name)) and p.is_dir())


def drop_states_after(root: str | Path, agent: str, *, step: int) -> list[int]:
    """Delete the states of steps after ``step``; returns their steps.

    The database names the state of the last step it committed. A newer state belongs to a step
    whose commit never happened: resuming from it would train that batch twice, and keeping it
    would block the step's next attempt ("already exists").
    """
    newer = [s for s in list_states(root, agent) if s > step]
    for s in newer:
        delete_state(root, agent, s)
    return newer


def delete_state(root: str | Path, agent: str, step: int) -> None:
    # Rename first, so a kill mid-delete leaves a temporary, never half a state under a real name.
    path = state_path(root, agent, step)
    doomed = path.with_name(f".deleting-{path.name}-{os.getpid()}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def list_trained_agents(root: str | Path) -> list[str]:
    """Agents a Trainer has saved state for (published or not yet)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if AGENT_NAME.match(p.name) and (p / "state").is_dir())


def list_agents(root: str | Path) -> list[str]:
    """Agents that have at least one published version."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(
        p.name for p in root.iterdir() if p.is_dir() and AGENT_NAME.match(p.name) and list_versions(root, p.name)
    )


def list_versions(root: str | Path, agent: str) -> list[int]:
    d = agent_dir(root, agent)
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := _VERSION_DIR.match(p.name)) and p.is_dir())


def read_latest(root: str | Path, agent: str, *, fallback: bool = True) -> int | None:
    """The version LATEST names; when LATEST is missing, the newest version dir (or None
    without ``fallback``: a writer must know whether LATEST itself was written)."""
    latest = agent_dir(root, agent) / "LATEST"
    try:
        text = latest.read_text().strip()
    except FileNotFoundError:
        versions = list_versions(root, agent) if fallback else []
        return versions[-1] if versions else None
    if not text.isdigit():
        raise CheckpointError(f"{latest} holds {text!r}, not a version number")
    return int(text)


def validate_version(root: str | Path, agent: str, version: int) -> AdapterVersion:
    """The version if its directory is complete, else CheckpointError naming what is missing."""
    path = version_dir(root, agent, version)
    if not path.is_dir():
        raise CheckpointError(f"{path} does not exist")
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        raise CheckpointError(f"{path} is incomplete: missing {', '.join(missing)}")
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except ValueError as e:
        raise CheckpointError(f"{path}/manifest.json is not valid JSON: {e}") from e
    if manifest.get("version") != version:
        raise CheckpointError(f"{path}/manifest.json says version {manifest.get('version')!r}")
    return AdapterVersion(agent=agent, version=version, path=path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    for p in sorted([path, *(q for q in path.rglob("*") if q.is_dir())]):
        _fsync_dir(p)


FILE_MODE, DIR_MODE = 0o644, 0o755  # published files are read by other processes, maybe as other users


def _make_readable(tree: Path) -> None:
    """mkdtemp makes 0700 directories and some writers 0600 files: open them to readers."""
    tree.chmod(DIR_MODE)
    for p in tree.rglob("*"):
        p.chmod(DIR_MODE if p.is_dir() else FILE_MODE)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` by write-temp, fsync, rename, fsync dir."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, FILE_MODE)  # mkstemp's 0600 would hide it from an Explorer running as another user
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_dir_atomic(final: Path, write: Callable[[Path], None]) -> Path:
    """Fill a temporary sibling of ``final`` with ``write(tmp)``, fsync it, rename it into place."""
    if final.exists():
        raise CheckpointError(f"{final} already exists")
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=parent))
    try:
        write(tmp)
        _make_readable(tmp)
        _fsync_tree(tmp)
        os.rename(tmp, final)
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def write_version(
    root: str | Path,
    agent: str,
    version: int,
    write_adapter: Callable[[Path], None],
    manifest: dict[str, Any],
) -> AdapterVersion:
    """Write ``v<version>`` atomically, without pointing LATEST at it (see ``set_latest``).

    ``write_adapter(dir)`` writes adapter_config.json and adapter_model.safetensors into ``dir``
    (e.g. ``peft_model.save_pretrained``). Raises CheckpointError if v<version> already exists.
    """
    final = version_dir(root, agent, version)
    if final.exists():
        raise CheckpointError(f"{final} already exists; versions are immutable")

    def write(tmp: Path) -> None:
        write_adapter(tmp)
        body = {**manifest, "version": version, "agent": agent, "created_at": time.time()}
        (tmp / "manifest.json").write_text(json.dumps(body, indent=2))
        missing = [f for f in REQUIRED_FILES if not (tmp / f).is_file()]
        if missing:
            raise CheckpointError(f"adapter writer left out {', '.join(missing)}")

    write_dir_atomic(final, write)
    return AdapterVersion(agent=agent, version=version, path=final)


@contextlib.contextmanager
def publication_lock(root: str | Path, agent: str, *, timeout_s: float | None = None) -> Iterator[None]:
    """Hold the agent's publication lock: only its holder picks the next version number and
    publishes it. Raises CheckpointError when ``timeout_s`` passes first (None: wait)."""
    with _flock(agent_dir(root, agent), PUBLISH_LOCK, timeout_s, "a Trainer step or another publication holds it"):
        yield


@contextlib.contextmanager
def release_lock(root: str | Path, agent: str, *, timeout_s: float | None = None) -> Iterator[None]:
    """Hold the agent's release lock: only its holder decides which version serves (promotes or
    rejects a candidate, rolls back). ``timeout_s=0``: try once (CheckpointError if held)."""
    with _flock(agent_dir(root, agent), RELEASE_LOCK, timeout_s, "another release decision is being taken"):
        yield


@contextlib.contextmanager
def _flock(d: Path, name: str, timeout_s: float | None, held_by: str) -> Iterator[None]:
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(d / name, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if deadline is None else fcntl.LOCK_NB))
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise CheckpointError(f"{d / name} stayed locked for {timeout_s:.0f}s ({held_by})") from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def set_latest(root: str | Path, agent: str, version: int) -> None:
    """Point LATEST at ``version`` (write-temp-and-rename: readers see the old or the new number)."""
    write_text_atomic(agent_dir(root, agent) / "LATEST", f"{version}\n")


def read_candidate(root: str | Path, agent: str) -> int | None:
    """The version CANDIDATE names (awaiting its release decision), or None."""
    path = agent_dir(root, agent) / "CANDIDATE"
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise CheckpointError(f"{path} holds {text!r}, not a version number")
    return int(text)


def set_candidate(root: str | Path, agent: str, version: int) -> None:
    """Name ``version`` the candidate (write-temp-and-rename). Without LATEST, LATEST is first
    written as 0 (the base model serves), so a reader's fallback to the newest directory can never
    serve a candidate."""
    if read_latest(root, agent, fallback=False) is None:
        set_latest(root, agent, 0)
    write_text_atomic(agent_dir(root, agent) / "CANDIDATE", f"{version}\n")


def clear_candidate(root: str | Path, agent: str, version: int) -> bool:
    """Remove CANDIDATE if it still names ``version`` (a newer candidate is left alone)."""
    path = agent_dir(root, agent) / "CANDIDATE"
    if read_candidate(root, agent) != version:
        return False
    path.unlink(missing_ok=True)
    _fsync_dir(path.parent)
    return True


def record_release(root: str | Path, agent: str, version: int, entry: dict[str, Any]) -> None:
    """Append a release decision to ``v<version>``'s manifest (``"release": [...]``), replacing the
    file atomically; the adapter files are untouched. A version already deleted is skipped."""
    path = version_dir(root, agent, version) / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        return
    entries = manifest.setdefault("release", [])
    if entry.get("id") is not None and any(e.get("id") == entry["id"] for e in entries):
        return  # already there (a decision carried out again after a crash)
    entries.append(entry)
    write_text_atomic(path, json.dumps(manifest, indent=2))


def publish_version(
    root: str | Path,
    agent: str,
    version: int,
    write_adapter: Callable[[Path], None],
    manifest: dict[str, Any],
) -> AdapterVersion:
    """Write a new version atomically and point LATEST at it (``write_version`` + ``set_latest``)."""
    v = write_version(root, agent, version, write_adapter, manifest)
    set_latest(root, agent, version)
    return v


def finish_publication(root: str | Path, agent: str, version: int, *, candidate: bool = False) -> AdapterVersion | None:
    """Complete a publication that was killed between renaming ``v<version>`` into place and
    writing LATEST (or, with ``candidate``, CANDIDATE): if the directory is complete, point LATEST at
    it (never backwards; CANDIDATE: at it) and return it. None when there is no such directory, so
    the caller writes the version afresh.

    A directory under the final name that fails validation cannot come from ``write_version``
    (it renames complete directories only); no reader can load it, so it is moved aside to
    ``.invalid-v<N>-<time>`` for inspection rather than left to block the version forever.
    """
    path = version_dir(root, agent, version)
    if not path.exists():
        return None
    try:
        done = validate_version(root, agent, version)
    except CheckpointError:
        os.rename(path, path.with_name(f".invalid-v{version}-{time.time_ns()}"))
        _fsync_dir(path.parent)
        return None
    if candidate:
        set_candidate(root, agent, version)
    elif (read_latest(root, agent, fallback=False) or 0) < version:
        set_latest(root, agent, version)
    return done


def remove_temporaries(root: str | Path, agent: str) -> list[Path]:
    """Delete what a killed atomic writer left in the agent dir and its state dir; returns them.

    Only the one Trainer of an agent writes there, so when it starts nothing is mid-write.
    """
    removed = []
    for d in (agent_dir(root, agent), state_dir(root, agent)):
        if not d.is_dir():
            continue
        for p in sorted(d.iterdir()):
            if not _TEMPORARY.match(p.name):
                continue
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def delete_version(root: str | Path, agent: str, version: int) -> None:
    """Remove an old version (callers decide when no reader can still use it)."""
    path = version_dir(root, agent, version)
    if read_latest(root, agent) == version:
        raise CheckpointError(f"refusing to delete {path}: LATEST points at it")
    # Rename first so a reader never sees a half-deleted version under its real name.
    doomed = path.with_name(f".deleting-v{version}-{os.getpid()}")
    os.rename(path, doomed)
    failpoint("checkpoints.version_renamed_for_deletion")  # a kill here leaves .deleting-*: remove_temporaries
    shutil.rmtree(doomed, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Serving files: each Explorer replica says which versions it still reads; retention keeps them.

SERVING_STALE_S = 120.0  # a replica that has not refreshed its serving file for this long is gone
SERVING_GONE_S = 3600.0  # ... and after this long its file is deleted


def serving_dir(root: str | Path, agent: str) -> Path:
    return agent_dir(root, agent) / ".serving"


def write_serving(root: str | Path, agent: str, *, replica: str, versions: list[int]) -> None:
    d = serving_dir(root, agent)
    d.mkdir(parents=True, exist_ok=True)
    write_text_atomic(d / f"{replica}.json", json.dumps({"replica": replica, "versions": versions, "updated_at": time.time()}))


def remove_serving(root: str | Path, agent: str, *, replica: str) -> None:
    (serving_dir(root, agent) / f"{replica}.json").unlink(missing_ok=True)


def versions_in_use(root: str | Path, agent: str, *, now: float | None = None) -> set[int]:
    """Versions that live Explorer replicas still read (serving files refreshed in the last
    ``SERVING_STALE_S``)."""
    now = time.time() if now is None else now
    used: set[int] = set()
    d = serving_dir(root, agent)
    if not d.is_dir():
        return used
    for f in d.glob("*.json"):
        try:
            body = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        age = now - float(body.get("updated_at", 0))
        if age <= SERVING_STALE_S:
            used.update(int(v) for v in body.get("versions", []))
        elif age > SERVING_GONE_S:  # a replica killed long ago: its file would stay forever
            f.unlink(missing_ok=True)
    return used
