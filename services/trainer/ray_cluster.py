"""The Trainer's own local Ray cluster, which never outlives it.

Ray ties its head processes (GCS, raylet) to the driver with PR_SET_PDEATHSIG, but not all of what
they start: after a ``kill -9`` of the Trainer its dashboard and runtime-env agents stayed alive,
and each restart started another cluster beside them. So the Trainer runs a small guard process
(``python -m services.trainer.ray_cluster``) that holds a pipe from it and the list of the
cluster's processes; the kernel closes the pipe however the Trainer dies, and the guard then kills
every listed process still alive. The list is also written to ``<run_dir>/ray-processes.json``, so a
restart removes what a killed guard could not (``kill -9`` of the whole process group takes the
guard with it, but then also every process of the group).

A process is named by pid and start time (``/proc/<pid>/stat`` field 22), so a pid the system
has given to another process since is never killed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("kaizen.trainer")

PROCESSES_FILE = "ray-processes.json"


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of ``pid``, or None when it is gone (or a zombie:
    dead, waiting only for its parent to collect it)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the name in parentheses may hold spaces
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[19])


def descendants(pid: int) -> list[tuple[int, int]]:
    """(pid, start time) of every process below ``pid`` (children, their children...)."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                children.setdefault(st[0], []).append((int(entry), st[1]))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child[0])
    return out


def kill_listed(processes: list[tuple[int, int]]) -> list[int]:
    """SIGKILL each (pid, start time) still alive as that same process; returns the pids killed."""
    killed = []
    for pid, started in processes:
        st = _stat(pid)
        if st is not None and st[1] == started:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


class LocalRayCluster:
    """``ray.init(address="local")`` plus the guard; ``track()`` after creating actors, ``shutdown()`` at the end."""

    def __init__(self, run_dir: str | Path):
        self.record = Path(run_dir) / PROCESSES_FILE
        self.guard: subprocess.Popen | None = None

    def start(self, **init_kwargs: Any) -> None:
        import ray

        self.remove_leftovers()
        ray.init(address="local", **init_kwargs)
        self.guard = subprocess.Popen([sys.executable, "-m", "services.trainer.ray_cluster"], stdin=subprocess.PIPE,
                                      cwd=Path(__file__).resolve().parents[2], text=True)
        self.track()

    def track(self) -> None:
        """Hand the cluster's current processes to the guard and to the record."""
        if self.guard is None:
            return
        processes = [p for p in descendants(os.getpid()) if p[0] != self.guard.pid]
        line = json.dumps(processes)
        me = _stat(os.getpid())
        self.record.parent.mkdir(parents=True, exist_ok=True)
        self.record.write_text(json.dumps({"owner": [os.getpid(), me[1] if me else 0], "processes": processes}))
        try:
            self.guard.stdin.write(line + "\n")
            self.guard.stdin.flush()
        except OSError:
            log.warning("the Ray guard process is gone; a killed Trainer may leave Ray processes behind")

    def remove_leftovers(self) -> None:
        """Kill what the cluster of an earlier, killed run of this Trainer left (its guard died with it)."""
        try:
            body = json.loads(self.record.read_text())
            owner, processes = tuple(body["owner"]), [tuple(p) for p in body["processes"]]
        except (OSError, ValueError, KeyError, TypeError):
            return
        st = _stat(owner[0])
        if st is not None and st[1] == owner[1]:
            # Its Trainer is alive: another Trainer shares this run_dir. Leave its cluster alone.
            log.warning("%s belongs to a running Trainer (pid %d); give each Trainer a run_dir of its own",
                        self.record, owner[0])
            return
        killed = kill_listed(processes)
        if killed:
            log.warning("killed %d processes of the Ray cluster an earlier run left behind: %s", len(killed), killed)
        self.record.unlink(missing_ok=True)

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        if self.guard is not None:
            try:
                self.guard.stdin.close()  # the guard kills whatever ray.shutdown left, then exits
                self.guard.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.guard.kill()
        self.record.unlink(missing_ok=True)


def _guard() -> None:
    """Read process lists (one JSON line each) until the Trainer's end of the pipe closes, then kill the last list."""
    # Ctrl-C or a SIGTERM to the process group are meant for the Trainer, which then stops in its own
    # time: the guard must outlive it to clean up.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    processes: list[tuple[int, int]] = []
    for line in sys.stdin:
        try:
            processes = [tuple(p) for p in json.loads(line)]
        except ValueError:
            continue
    kill_listed(processes)


if __name__ == "__main__":
    _guard()
