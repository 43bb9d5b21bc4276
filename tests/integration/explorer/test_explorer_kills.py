"""kill -9 of a real `kaizen explorer` under concurrent chat + feedback + commit, three times, on
SQLite and PostgreSQL: after the last restart every acknowledged feedback and commit is in the
buffer (0 lost), and every acknowledged chat too (the local journal replays what the database had
not taken yet). The counts are printed (the closing note and README quote them)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest

from tests.helpers import free_port, kaizen_process, wait_http
from tests.integration.traffic import Traffic

pytestmark = pytest.mark.integration

CLIENTS = 8
KILLS = 3


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_kill_9_under_traffic_loses_nothing_acknowledged(tiny_model, tmp_path, backend, request):
    url = f"sqlite:///{tmp_path}/b.db" if backend == "sqlite" else request.getfixturevalue("postgres_db_url")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = ["explorer", f"model.path={tiny_model}", f"buffer.url={url}", f"checkpoints.root={tmp_path}/ck",
            f"server.port={port}", f"recorder.journal_dir={tmp_path}/journal", "reload.enabled=false"]
    traffic = Traffic(base)
    threads = [threading.Thread(target=traffic.client, args=(k,), daemon=True) for k in range(CLIENTS)]
    rng = random.Random(7)
    started = False
    for life in range(KILLS + 1):
        with kaizen_process(*args, log_path=tmp_path / f"explorer-{life}.log") as proc:
            wait_http(f"{base}/health", proc=proc)
            if not started:
                for t in threads:
                    t.start()
                started = True
            time.sleep(rng.uniform(2.0, 4.0))
            # and until this life acknowledged its share of the traffic (a loaded machine restarts slowly)
            deadline = time.monotonic() + 30
            while len(traffic.commits) <= 25 * (life + 1) and time.monotonic() < deadline:
                time.sleep(0.1)
            if life < KILLS:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(30)
            else:
                traffic.stop.set()
                for t in threads:
                    t.join(60)
        # the last life ends with SIGTERM (kaizen_process): a clean stop writes what waits
    lost_chats, lost_rewards, lost_commits = traffic.lost(url)
    print(f"\n{backend}: {KILLS} kills of kill -9 under {CLIENTS} clients: acknowledged {len(traffic.chats)} chats, "
          f"{len(traffic.rewards)} feedbacks, {len(traffic.commits)} commits ({traffic.failed} requests failed while "
          f"down); lost {len(lost_chats)} chats, {len(lost_rewards)} feedbacks, {len(lost_commits)} commits")
    assert len(traffic.commits) > 20 * (KILLS + 1), "too little traffic to mean anything"
    assert lost_rewards == [] and lost_commits == []
    assert lost_chats == []  # the journal is written before each answer and replayed at start
