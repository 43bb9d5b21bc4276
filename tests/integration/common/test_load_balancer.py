"""Three real `kaizen explorer` replicas on one PostgreSQL, one checkpoint folder and one journal
directory, behind a real load balancer (HAProxy from the distribution's packages, round robin with
health checks on /health; `make test` installs it when it runs as root with apt, elsewhere these
tests skip and say why), driven by 16 clients with their own keys:

  - a key's global request quota holds across the replicas (the slack is what refills while the
    burst runs, nothing per replica);
  - multi-call episodes keep the version they began on while the balancer sends their calls to
    different replicas and a new version goes live;
  - a user's deletion sent to two replicas at once deletes the user's rows once, and what other
    replicas still held of that user when it ran is never written after it;
  - kill -9 of one replica under chat + feedback + commit traffic: the others stay healthy, the
    clients' retries go to them, and once a survivor adopted the dead replica's journal, 0
    acknowledged chats, feedbacks or commits are missing from the buffer (without a restart).

The module's replicas are shared by its tests, in file order; the kill comes last."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from services.common.http.access import key_digest
from tests.helpers import free_port, fresh_database, kaizen_process, wait_http
from tests.integration.adapters import publish_adapter, train_reply_adapter
from tests.integration.traffic import Traffic

pytestmark = pytest.mark.integration

REPLICAS = 3
CLIENTS = 16
KEYS = [f"kz-test-lb-client-{k:02d}-0123456789abcdef" for k in range(CLIENTS)]
CAPPED = "kz-test-lb-capped-0123456789abcdef"
CAPPED_PER_MIN = 20
ADMIN = "kz-test-lb-admin-0123456789abcdef"
ASK = [{"role": "user", "content": "Where should I go?"}]
TARGETS = {1: "Go to paris.", 2: "Go to london."}


def _haproxy() -> str:
    exe = shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.access(p, os.X_OK)), None)
    if exe is None:
        pytest.skip("no HAProxy on this machine (make test installs Debian's haproxy when it runs as root with apt)")
    return exe


HAPROXY_CFG = """global
    maxconn 512
defaults
    mode http
    timeout connect 2s
    timeout client 60s
    timeout server 60s
    retries 2
    option redispatch 1
frontend kaizen
    bind 127.0.0.1:{port}
    default_backend explorers
backend explorers
    balance roundrobin
    option httpchk GET /health
    http-check expect status 200
    default-server inter 200ms fall 2 rise 2
    http-response set-header X-Served-By %s
{servers}
"""


@dataclass
class Cluster:
    url: str  # the load balancer
    replicas: list[str]  # each replica's own address
    procs: list[subprocess.Popen]
    db_url: str
    root: Path
    journal: Path


@pytest.fixture(scope="module")
def adapters(tiny_model):
    return {v: train_reply_adapter(tiny_model, ASK, t) for v, t in TARGETS.items()}


@pytest.fixture(scope="module")
def cluster(tiny_model, postgres_url, tmp_path_factory, adapters):
    haproxy = _haproxy()
    tmp = tmp_path_factory.mktemp("lb")
    root = tmp / "checkpoints"
    publish_adapter(adapters[1], root, "guide", 1)
    keys = [{"name": f"client-{k:02d}", "sha256": key_digest(s), "scopes": ["chat", "feedback", "read"]} for k, s in enumerate(KEYS)]
    keys.append({"name": "capped", "sha256": key_digest(CAPPED), "scopes": ["chat"], "requests_per_min": CAPPED_PER_MIN})
    keys.append({"name": "ops", "sha256": key_digest(ADMIN), "scopes": ["admin", "read"]})
    ports = [free_port() for _ in range(REPLICAS)]
    with ExitStack() as stack:
        db_url = stack.enter_context(fresh_database(postgres_url))
        procs = [stack.enter_context(kaizen_process(
            "explorer", f"model.path={tiny_model}", f"buffer.url={db_url}", f"checkpoints.root={root}",
            f"recorder.journal_dir={tmp}/journal", "recorder.journal_adopt_s=1",
            "reload.poll_interval_s=0.2", f"server.port={port}", "auth.keys=" + json.dumps(keys),
            log_path=tmp / f"explorer-{i}.log")) for i, port in enumerate(ports)]
        replicas = [f"http://127.0.0.1:{p}" for p in ports]
        for url, proc in zip(replicas, procs):
            wait_http(f"{url}/health", proc=proc)
        lb_port = free_port()
        servers = "\n".join(f"    server r{i} 127.0.0.1:{p} check" for i, p in enumerate(ports))
        cfg = tmp / "haproxy.cfg"
        cfg.write_text(HAPROXY_CFG.format(port=lb_port, servers=servers))
        log = stack.enter_context(open(tmp / "haproxy.log", "wb"))
        lb = subprocess.Popen([haproxy, "-db", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT)
        stack.callback(lambda: (lb.terminate(), lb.wait(10)))
        url = f"http://127.0.0.1:{lb_port}"
        wait_http(f"{url}/health", timeout=30, proc=lb)
        deadline = time.monotonic() + 30  # until the balancer has seen every replica healthy
        while len({httpx.get(f"{url}/health", timeout=5).headers.get("x-served-by") for _ in range(2 * REPLICAS)}) < REPLICAS:
            assert time.monotonic() < deadline, "the balancer did not mark all replicas up"
            time.sleep(0.2)
        yield Cluster(url=url, replicas=replicas, procs=procs, db_url=db_url, root=root, journal=tmp / "journal")


def test_a_keys_quota_holds_across_the_replicas(cluster):
    """16 clients of one key, 64 requests at once, spread by the balancer over three replicas: the
    key's 20 a minute, plus what refilled while they ran (one every 3 s), and never one per replica."""
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"Authorization": f"Bearer {CAPPED}"}

    def ask(_):
        r = httpx.post(f"{cluster.url}/v1/chat/completions", json=body, headers=headers, timeout=60)
        return r.status_code, r.headers.get("x-served-by")

    start = time.monotonic()
    with ThreadPoolExecutor(CLIENTS) as pool:
        answers = list(pool.map(ask, range(4 * CLIENTS)))
    elapsed = time.monotonic() - start
    codes = Counter(code for code, _ in answers)
    assert set(codes) <= {200, 429}, codes
    refilled = int(elapsed * CAPPED_PER_MIN / 60) + 1
    print(f"\nquota of {CAPPED_PER_MIN}/min over {REPLICAS} replicas: {codes[200]} of {len(answers)} admitted "
          f"in {elapsed:.1f}s (at most {CAPPED_PER_MIN} + {refilled} refilled)")
    assert CAPPED_PER_MIN <= codes[200] <= CAPPED_PER_MIN + refilled
    assert {by for code, by in answers if code == 200} == {f"r{i}" for i in range(REPLICAS)}  # all three admitted some


def _versions(cluster, version: int, timeout: float = 30.0) -> None:
    """Wait until every replica serves ``version`` of guide to new episodes."""
    deadline = time.monotonic() + timeout
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    for url in cluster.replicas:
        while {m["id"]: m for m in httpx.get(f"{url}/v1/models", headers=headers).json()["data"]}["guide"]["version"] != version:
            assert time.monotonic() < deadline, f"{url} did not load v{version}"
            time.sleep(0.1)


def test_episodes_keep_their_version_while_the_balancer_alternates_replicas(cluster, adapters):
    _versions(cluster, 1)
    clients = [httpx.Client(base_url=cluster.url, headers={"Authorization": f"Bearer {k}"}, timeout=60) for k in KEYS]
    served: dict[int, list[tuple[str, str]]] = {}

    def call(episode: int) -> None:
        r = clients[episode].post("/v1/chat/completions", json={
            "model": "guide", "messages": ASK, "temperature": 0, "max_tokens": 12,
            "metadata": {"task_id": "trip", "run_id": f"lb-{episode}"}})
        assert r.status_code == 200, r.text
        served.setdefault(episode, []).append((r.json()["system_fingerprint"], r.headers["x-served-by"]))

    old, new = range(0, 8), range(8, 16)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(call, old))  # their first calls, on v1
        publish_adapter(adapters[2], cluster.root, "guide", 2)
        _versions(cluster, 2)
        for _ in range(3):  # their next calls, wherever the balancer sends them: still v1
            list(pool.map(call, old))
        for _ in range(2):
            list(pool.map(call, new))  # new episodes begin on v2 and stay there
    for c in clients:
        c.close()
    assert all([fp for fp, _ in served[e]] == ["kaizen-guide-v1"] * 4 for e in old), served
    assert all([fp for fp, _ in served[e]] == ["kaizen-guide-v2"] * 2 for e in new), served
    moved = sum(len({by for _, by in served[e]}) > 1 for e in old)
    assert moved >= 4, served  # most old episodes were served by more than one replica


def test_a_users_deletion_sent_to_two_replicas_at_once_acts_once(cluster):
    """A user's chats spread over the replicas, then the deletion sent twice at once (the balancer
    gives each to another replica): the rows go once (the two reports add up to them), each leaves
    a tombstone, and both requests are in the audit log."""
    from sqlalchemy import create_engine, text

    headers = {"Authorization": f"Bearer {KEYS[1]}"}
    chats = [httpx.post(f"{cluster.url}/v1/chat/completions", headers=headers, timeout=60, json={
        "model": "default", "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 2,
        "metadata": {"user_id": "lb-user"}}) for i in range(12)]
    assert [r.status_code for r in chats] == [200] * 12
    assert len({r.headers["x-served-by"] for r in chats}) == REPLICAS
    db = create_engine(cluster.db_url)

    def count(sql: str) -> int:
        with db.connect() as conn:
            return conn.execute(text(sql)).scalar()

    rows = lambda: count("SELECT count(*) FROM experiences WHERE user_id = 'lb-user'")  # noqa: E731
    try:
        deadline = time.monotonic() + 30  # every replica's recorder has written its share
        while rows() < 12:
            assert time.monotonic() < deadline, f"only {rows()} of the 12 chats were written"
            time.sleep(0.1)

        def delete(_, user: str = "lb-user"):
            return httpx.delete(f"{cluster.url}/experiences", params={"user_id": user},
                                headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)

        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(delete, range(2)))
        assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
        assert len({r.headers["x-served-by"] for r in answers}) == 2  # two replicas acted
        assert sorted(r.json()["deleted"] for r in answers) == [0, 12]
        assert rows() == 0
        assert count("SELECT count(*) FROM tombstones WHERE agent = 'default'") == 12
        assert count("SELECT count(*) FROM audit_log WHERE action = 'delete_user_data' AND actor = 'ops'") == 2

        # a user still chatting while the deletion runs: whatever any replica still held then (its
        # recorder's queue) is not written after it; what the user says afterwards is kept
        stop = threading.Event()
        sent = []

        def chatting() -> None:
            while not stop.is_set():
                r = httpx.post(f"{cluster.url}/v1/chat/completions", headers=headers, timeout=60, json={
                    "model": "default", "messages": [{"role": "user", "content": "still here"}], "max_tokens": 2,
                    "metadata": {"user_id": "lb-user-2"}})
                sent.append(r.status_code)

        talkers = [threading.Thread(target=chatting, daemon=True) for _ in range(6)]
        for t in talkers:
            t.start()
        while len(sent) < 30:
            time.sleep(0.05)
        assert delete(0, "lb-user-2").status_code == 200
        while len(sent) < 60:
            time.sleep(0.05)
        stop.set()
        for t in talkers:
            t.join(60)
        assert set(sent) == {200}
        time.sleep(3)  # every recorder has written what it held
        deleted_at = count("SELECT max(deleted_at) FROM deleted_users WHERE user_sha256 = "
                           f"'{hashlib.sha256(b'lb-user-2').hexdigest()}'")
        with db.connect() as conn:
            kept = [t for t, in conn.execute(text("SELECT created_at FROM experiences WHERE user_id = 'lb-user-2'"))]
        assert kept and all(t > deleted_at for t in kept), (deleted_at, sorted(kept)[:3])
    finally:
        db.dispose()


def test_kill_9_of_a_replica_under_traffic_loses_nothing_acknowledged(cluster):
    traffic = Traffic(cluster.url, keys=KEYS)
    threads = [threading.Thread(target=traffic.client, args=(k,), daemon=True) for k in range(CLIENTS)]
    for t in threads:
        t.start()

    def until_commits(n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while len(traffic.commits) < n:
            assert time.monotonic() < deadline, f"only {len(traffic.commits)} commits acknowledged"
            time.sleep(0.1)

    until_commits(60)
    victim = cluster.procs[1]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(30)
    killed_at = len(traffic.commits)
    until_commits(killed_at + 60)  # the clients go on, through the two survivors
    for url in (cluster.replicas[0], cluster.replicas[2]):
        assert httpx.get(f"{url}/health", timeout=10).json()["status"] in ("ok", "degraded")
    traffic.stop.set()
    for t in threads:
        t.join(60)
    deadline = time.monotonic() + 30  # a survivor adopts the dead replica's journal within journal_adopt_s
    left = lambda: sorted(cluster.journal.glob(f"segment-*-{victim.pid}-*.jsonl"))  # noqa: E731
    while (left() or any(traffic.lost(cluster.db_url))) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left() == []  # adopted, written and deleted by a survivor
    lost_chats, lost_rewards, lost_commits = traffic.lost(cluster.db_url)
    print(f"\nkill -9 of 1 of {REPLICAS} replicas behind HAProxy under {CLIENTS} clients: acknowledged "
          f"{len(traffic.chats)} chats, {len(traffic.rewards)} feedbacks, {len(traffic.commits)} commits "
          f"({traffic.failed} requests failed and were retried); lost {len(lost_chats)} chats, "
          f"{len(lost_rewards)} feedbacks, {len(lost_commits)} commits")
    assert (lost_chats, lost_rewards, lost_commits) == ([], [], [])
    for url in (cluster.replicas[0], cluster.replicas[2]):
        assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
