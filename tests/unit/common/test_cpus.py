"""The CPUs a process may use: its affinity, lowered by a container's CPU quota (cgroup v2 cpu.max)."""

from __future__ import annotations

import os

from services.common.cpus import usable_cpus


def test_a_quota_lowers_the_count_and_max_or_no_file_leaves_the_affinity(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    f = tmp_path / "cpu.max"
    assert usable_cpus(tmp_path / "absent") == affinity
    f.write_text("max 100000\n")
    assert usable_cpus(f) == affinity
    f.write_text("50000 100000\n")  # half a CPU: one thread
    assert usable_cpus(f) == 1
    f.write_text(f"{150000 * affinity} 100000\n")  # more than the affinity allows: the affinity
    assert usable_cpus(f) == affinity
    f.write_text("garbage\n")
    assert usable_cpus(f) == affinity
