"""`make bench` section quotas: what counting API keys' quotas in the database (auth.quotas: database,
shared by every replica) costs against counting them in the process, side by side in one run.

    python -m tests.bench.quotas        # KAIZEN_BENCH_PG_URL=postgresql+psycopg://... adds PostgreSQL

Each round: 400 admissions of one key (a requests-a-minute quota large enough to admit them all) from
1 and from 4 threads, then 200 token reservations each settled; 3 rounds, alternating, median and range.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from tests.bench.common import table

N_ADMIT, N_HOLD = 400, 200


def _round(q, threads: int) -> tuple[float, float]:
    """(admissions per second, reservations + settlements per second)."""
    from services.common.http.access import Principal

    k = Principal(name=f"bench-{uuid.uuid4().hex[:8]}", scopes=frozenset({"chat"}), requests_per_min=10**9,
                  tokens_per_min=10**9)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        admitted = list(pool.map(lambda _: q.admit(k), range(N_ADMIT)))
    admit_s = time.perf_counter() - t0
    assert all(a is None for a in admitted)
    t0 = time.perf_counter()
    for i in range(N_HOLD):
        hold = f"h{i}-{k.name}"
        assert q.reserve_tokens(k, 100, hold) is None
        q.settle_tokens(k, 100, 50, hold)
    if hasattr(q, "drain"):
        q.drain(60)
    return N_ADMIT / admit_s, N_HOLD / (time.perf_counter() - t0)


def main() -> str:
    from services.common import buffer
    from services.common.http.access import Quotas, SharedQuotas

    folder = tempfile.mkdtemp(prefix="kaizen-bench-quotas-")
    stores = {"process": None, "sqlite": f"sqlite:///{folder}/buffer.db"}
    if os.environ.get("KAIZEN_BENCH_PG_URL"):
        stores["postgresql"] = os.environ["KAIZEN_BENCH_PG_URL"]
    quotas, engines = {}, []
    for name, url in stores.items():
        if url is None:
            quotas[name] = Quotas()
        else:
            engines.append(buffer.create_buffer_engine(url))
            quotas[name] = SharedQuotas(engines[-1])
    res: dict[tuple[str, int], list[tuple[float, float]]] = {(n, t): [] for n in quotas for t in (1, 4)}
    for r in range(3):
        for name in (list(quotas) if r % 2 == 0 else list(quotas)[::-1]):
            for threads in (1, 4):
                res[(name, threads)].append(_round(quotas[name], threads))
    rows = []
    for (name, threads), xs in res.items():
        a, h = [x[0] for x in xs], [x[1] for x in xs]
        rows.append([name, threads, f"{statistics.median(a):,.0f}", f"{min(a):,.0f}-{max(a):,.0f}",
                     f"{statistics.median(h):,.0f}", f"{min(h):,.0f}-{max(h):,.0f}"])
    for q in quotas.values():
        q.close()
    for e in engines:
        e.dispose()
    note = "" if "postgresql" in stores else " (set KAIZEN_BENCH_PG_URL to add PostgreSQL)"
    return table(f"quotas: one key's admissions and token reservations, in the process and in the database{note}",
                 ["store", "threads", "admissions/s", "range", "reserve+settle/s (1 thread)", "range"], rows)


if __name__ == "__main__":
    print(main())
