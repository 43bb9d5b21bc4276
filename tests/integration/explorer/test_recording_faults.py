"""Nothing acknowledged is forgotten: a real `kaizen explorer` keeps answering while its database
is write-locked, says so on /health, tells feedback to retry (503), is then killed with SIGKILL, and
after a restart with the database back every chat it answered is in the buffer."""

from __future__ import annotations

import concurrent.futures
import signal
import time

import httpx
import pytest

from services.common import buffer
from tests.helpers import free_port, kaizen_process, wait_http, write_locked

pytestmark = pytest.mark.integration


def _chat(url: str, i: int) -> list[str]:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "default", "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 4, "n": 2,
        "metadata": {"task_id": f"t{i}"}})
    assert r.status_code == 200, r.text
    return [c["experience_id"] for c in r.json()["choices"]]


def _feedback_as_a_client_would(url: str, ids: list[str]) -> httpx.Response:
    """Feedback after the restart: it waits for the replayed records, then applies. A 503 with
    Retry-After (the buffer passing through a moment it cannot be reached: the project's CI once met
    one on PostgreSQL) is retried as its contract and the runner SDK do, at most three times."""
    for _ in range(3):
        fb = httpx.post(f"{url}/feedback", json={"msg_ids": ids, "reward": 1.0}, timeout=30)
        if fb.status_code != 503 or "retry-after" not in fb.headers:
            return fb
        time.sleep(float(fb.headers["retry-after"]))
    return fb


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_acknowledged_chats_survive_a_locked_database_and_a_kill_9(tiny_model, tmp_path, backend, request):
    url = f"sqlite:///{tmp_path}/b.db" if backend == "sqlite" else request.getfixturevalue("postgres_db_url")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = ["explorer", f"model.path={tiny_model}", f"buffer.url={url}", f"checkpoints.root={tmp_path}/ck",
            f"server.port={port}", f"recorder.journal_dir={tmp_path}/journal", "recorder.degraded_after_s=0.5",
            "recorder.feedback_wait_s=1", "reload.enabled=false"]
    acknowledged: list[str] = []
    with kaizen_process(*args, log_path=tmp_path / "explorer.log") as proc:
        wait_http(f"{base}/health", proc=proc)
        with write_locked(url):
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                for ids in pool.map(lambda i: _chat(base, i), range(24)):
                    acknowledged += ids
            time.sleep(0.6)
            health = httpx.get(f"{base}/health").json()
            assert health["status"] == "degraded" and health["recorder"]["pending"] == len(acknowledged), health
            t0 = time.monotonic()
            fb = httpx.post(f"{base}/feedback", json={"msg_ids": [acknowledged[0]], "reward": 1.0}, timeout=30)
            assert fb.status_code == 503 and fb.headers["retry-after"], fb.text
            assert fb.json()["error"]["code"] == "buffer_unavailable"
            assert time.monotonic() - t0 < 10
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
    db = buffer.create_buffer_engine(url)
    try:
        assert buffer.count_by_status(engine=db).get("recorded", 0) == 0  # nothing reached the database
        with kaizen_process(*args, log_path=tmp_path / "explorer2.log") as proc:
            wait_http(f"{base}/health", proc=proc)
            fb = _feedback_as_a_client_would(base, acknowledged[:2])
            assert fb.status_code == 200, f"{fb.text}\n{(tmp_path / 'explorer2.log').read_text()[-3000:]}"
        stored = {e.experience_id for e in buffer.list_experiences(engine=db, limit=1000)}
        assert stored == set(acknowledged)
        assert not list((tmp_path / "journal").glob("segment-*.jsonl"))
    finally:
        db.dispose()
    assert "records of an earlier run were not in the buffer yet" in (tmp_path / "explorer2.log").read_text()
