"""`kaizen explorer` and `kaizen tiny-model` as a user runs them."""

from __future__ import annotations

import hashlib
import http.client
import subprocess
import time
import sys

import openai
import pytest

from tests.helpers import REPO, free_port, kaizen_process, wait_http

pytestmark = pytest.mark.integration


def test_kaizen_explorer_serves_with_the_shipped_config(tiny_model, tmp_path):
    port = free_port()
    args = ["explorer", "--config", "configs/explorer.yaml", f"model.path={tiny_model}",
            f"buffer.url=sqlite:///{tmp_path}/b.db", f"checkpoints.root={tmp_path}/ck", f"server.port={port}"]
    with kaizen_process(*args, log_path=tmp_path / "explorer.log") as proc:
        wait_http(f"http://127.0.0.1:{port}/health", proc=proc)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert r.choices[0].model_extra["experience_id"]
        # An idle keep-alive connection outlives clients' own 5 s expiry (server.keep_alive_s), so a
        # client never reuses one the server is closing at that moment (a ReadError under load).
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        socks = []
        for k in range(2):
            conn.request("GET", "/health")
            resp = conn.getresponse()
            assert resp.status == 200 and resp.read()
            socks.append(conn.sock)
            if k == 0:
                time.sleep(6)  # idle between the two requests
        assert socks[0] is socks[1]  # the same connection, still open after 6 s idle
        conn.close()
    log = (tmp_path / "explorer.log").read_text()
    assert "explorer config:" in log and f"port: {port}" in log  # the resolved config is logged


def test_unknown_config_key_is_named(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "services.cli", "explorer", "--config", "configs/explorer.yaml", "engine.batch=4"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 2
    assert "unknown config key 'engine.batch'" in r.stderr


def test_missing_model_is_a_clear_error(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "services.cli", "explorer", f"model.path={tmp_path}/nothing-here",
         f"buffer.url=sqlite:///{tmp_path}/b.db", f"checkpoints.root={tmp_path}/ck", f"server.port={free_port()}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert r.returncode != 0
    assert "kaizen tiny-model" in r.stderr


def test_tiny_model_is_deterministic_and_loads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in ("a", "b"):
        subprocess.run([sys.executable, "-m", "services.cli", "tiny-model", str(tmp_path / name)], cwd=REPO, check=True, timeout=300)
    digest = lambda d: {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}  # noqa: E731
    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    tok = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert model.config.model_type == "qwen2" and model.config.head_dim >= 32
    assert tok.chat_template and "<tool_call>" in tok.get_vocab()
