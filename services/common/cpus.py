"""How many CPUs this process may use (no torch here: the Trainer's driver and the demo's process read it too)."""

from __future__ import annotations

import math
import os
from pathlib import Path

CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def usable_cpus(cpu_max: Path | None = None) -> int:
    """The CPUs this process may run on (its affinity), and fewer where a container's CPU quota (cgroup v2
    ``cpu.max``: quota and period in microseconds, or ``max``) allows less time than that."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = (cpu_max or CPU_MAX).read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cpus
