"""Observability with real processes: JSON logs from `kaizen explorer` whose request ids match the
X-Request-Id of the answer and the recorded experience; the real `kaizen trainer` serving
Prometheus metrics (trainer.metrics_port); every metric the Grafana dashboard in deploy/ queries
exists in one of the two services' /metrics."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.helpers import REPO, free_port, kaizen_process, wait_http
from tests.integration.trainer.data import fill_buffer

pytestmark = pytest.mark.integration


def _json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def _metric_names(exposition: str) -> set[str]:
    return set(re.findall(r"^# TYPE (\S+)", exposition, flags=re.M))


def _known(name: str, names: set[str]) -> bool:
    base = re.sub(r"_(total|bucket|sum|count)$", "", name)
    return name in names or base in names


def test_json_logs_metrics_and_the_grafana_dashboard(tiny_model, tmp_path, ray_address):
    # --- the Explorer: JSON logs carrying the request id of the answer and of the record
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "explorer.log"
    args = ["explorer", f"model.path={tiny_model}", f"buffer.url=sqlite:///{tmp_path}/b.db",
            f"checkpoints.root={tmp_path}/ck", f"server.port={port}", "server.log_format=json"]
    with kaizen_process(*args, log_path=log_path) as proc:
        wait_http(f"{base}/health", proc=proc)
        body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"X-Request-Id": "trace-7f3a"}, timeout=60)
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-7f3a"
        eid = r.json()["choices"][0]["experience_id"]
        made_up = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).headers["x-request-id"]
        assert made_up.startswith("req-")
        missing = httpx.post(f"{base}/v1/chat/completions", json={**body, "model": "default@v9"},
                             headers={"X-Request-Id": "trace-404"}, timeout=60)
        assert missing.status_code == 404 and missing.headers["x-request-id"] == "trace-404"
        time.sleep(0.5)
        assert httpx.get(f"{base}/experiences/{eid}", timeout=30).json()["request_id"] == "trace-7f3a"
        explorer_metrics = httpx.get(f"{base}/metrics", timeout=30).text
    text = log_path.read_text()
    assert all(line.startswith("{") for line in text.splitlines() if line.strip()), text[:2000]
    lines = _json_lines(text)
    assert lines and all({"time", "level", "logger", "message"} <= set(x) for x in lines)
    assert any(x.get("request_id") == "trace-404" and "not servable" in x["message"] for x in lines), lines[-5:]

    # --- the Trainer: Prometheus metrics on trainer.metrics_port, JSON logs
    url = f"sqlite:///{tmp_path}/train.db"
    fill_buffer(url, tiny_model, prompts=[f"Task {i}" for i in range(8)], n=4)
    trainer_log = tmp_path / "trainer.log"
    with open(trainer_log, "wb") as out:
        trainer = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "trainer", "--config", "configs/trainer.yaml", f"model.path={tiny_model}",
             f"buffer.url={url}", f"checkpoints.root={tmp_path}/tck", f"trainer.run_dir={tmp_path}/run",
             f"ray.address={ray_address}", "train_batch_size=8", "staleness.max_staleness=100", "trainer.metrics_port=0",
             "log_format=json", "trainer.poll_interval_s=0.2"],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while "waiting for committed experiences" not in trainer_log.read_text():
            assert trainer.poll() is None and time.monotonic() < deadline, trainer_log.read_text()[-3000:]
            time.sleep(0.2)
        logged = _json_lines(trainer_log.read_text())
        where = next(x["message"] for x in logged if x["message"].startswith("Prometheus metrics on "))
        trainer_metrics = httpx.get(where.split(" on ", 1)[1], timeout=30).text
    finally:
        trainer.send_signal(signal.SIGTERM)
        trainer.wait(120)
    assert re.search(r'^kaizen_trainer_steps_total\{agent="default"\} 4\.0$', trainer_metrics, re.M), trainer_metrics
    assert re.search(r'^kaizen_trainer_experiences_total\{agent="default",outcome="consumed"\} 32\.0$', trainer_metrics, re.M)
    assert re.search(r'^kaizen_trainer_version\{agent="default"\} 4\.0$', trainer_metrics, re.M)
    assert re.search(r'^kaizen_trainer_reward_mean\{agent="default"\} ', trainer_metrics, re.M)
    assert 'kaizen_trainer_waiting 1.0' in trainer_metrics

    # --- the dashboard asks only for metrics that exist
    names = _metric_names(explorer_metrics) | _metric_names(trainer_metrics)
    dashboard = json.loads((REPO / "deploy" / "grafana" / "kaizen.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\b(kaizen_[a-z_]+)\b", e)}
    assert len(used) > 20
    assert not [m for m in sorted(used) if not _known(m, names)], sorted(m for m in used if not _known(m, names))
