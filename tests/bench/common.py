"""Shared bench helpers: load generation, percentiles, printing."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

TINY = ".cache/tiny-model"


@dataclass
class LoadResult:
    completions: int
    tokens: int
    seconds: float
    latencies: list[float]
    failures: int = 0

    @property
    def completions_per_s(self) -> float:
        return self.completions / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def p(self, q: float) -> float:
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def run_load(one: Callable[[int], Awaitable[int]], *, concurrency: int, total: int) -> LoadResult:
    """Call ``one(i)`` (returns tokens generated) ``total`` times, ``concurrency`` at once."""
    queue = list(range(total))
    latencies: list[float] = []
    tokens = 0
    failures = 0

    async def worker():
        nonlocal tokens, failures
        while queue:
            i = queue.pop()
            t0 = time.perf_counter()
            try:
                n = await one(i)  # not `tokens += await ...`: that reads tokens before awaiting
            except Exception:
                failures += 1
                continue
            tokens += n
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return LoadResult(len(latencies), tokens, time.perf_counter() - t0, latencies, failures)


def mean(xs):
    return statistics.fmean(xs)


def table(title: str, header: list[str], rows: list[list]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "  ".join(str(x).rjust(w) for x, w in zip(r, widths))  # noqa: E731
    out = [f"\n== {title}", line(header), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    return "\n".join(out)


def clock_ticks_per_s() -> int:
    return os.sysconf("SC_CLK_TCK")


def machine_busy_ticks() -> int:
    """Busy clock ticks of the whole machine (all CPUs, everything but idle and iowait)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4]


def proc_stats():
    """(pid, command name, the fields after it) of every live process, from /proc/<pid>/stat."""
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                s = f.read()
        except OSError:
            continue
        yield int(p), s[s.index("(") + 1 : s.rindex(")")], s[s.rindex(")") + 2 :].split()
