"""Schemathesis against the Explorer's own OpenAPI schema, for a bounded time, on a real `kaizen
explorer` with keys on: no 5xx, no request slower than a stated bound, the server alive, and what
was accepted before the fuzzing (chats, rewards, commits) unchanged after it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from services.common import buffer
from services.common.http.access import key_digest
from tests.helpers import free_port, kaizen_process, wait_http

pytestmark = pytest.mark.integration

FUZZ_SECONDS = 60  # about 3,000 generated requests on 2 cores
KEY = "kz-fuzz-key-0123456789"


def test_schemathesis_finds_no_server_error(tiny_model, tmp_path):
    st = Path(sys.executable).with_name("schemathesis")
    if not st.exists() and not shutil.which("schemathesis"):
        pytest.skip("schemathesis is not installed (pip install -e '.[test]')")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    url = f"sqlite:///{tmp_path}/b.db"
    keys = f'auth.keys=[{{"name": "fuzz", "sha256": "{key_digest(KEY)}", "scopes": ["chat", "feedback", "read", "admin"]}}]'
    args = ["explorer", f"model.path={tiny_model}", f"buffer.url={url}", f"checkpoints.root={tmp_path}/ck",
            f"server.port={port}", f"recorder.journal_dir={tmp_path}/journal", "engine.max_model_len=512",
            "server.default_max_tokens=8", keys]
    headers = {"Authorization": f"Bearer {KEY}"}
    with kaizen_process(*args, log_path=tmp_path / "explorer.log") as proc:
        wait_http(f"{base}/health", proc=proc)
        http = httpx.Client(base_url=base, headers=headers, timeout=60)
        before = []
        for i in range(4):
            r = http.post("/v1/chat/completions", json={"model": "default", "max_tokens": 2,
                                                        "messages": [{"role": "user", "content": f"kept {i}"}]})
            before.append(r.json()["choices"][0]["experience_id"])
        assert http.post("/feedback", json={"msg_ids": before, "reward": 0.25}).status_code == 200
        assert http.post("/commit", json={"msg_ids": before}).json()["committed"] == 4
        snapshot = {e: http.get(f"/experiences/{e}").json() for e in before}

        out = subprocess.run(
            [str(st if st.exists() else shutil.which("schemathesis")), "run", f"{base}/openapi.json",
             "--checks", "not_a_server_error", "--max-time", str(FUZZ_SECONDS), "--max-examples", "40",
             "--request-timeout", "60", "--max-response-time", "30", "-H", f"Authorization: Bearer {KEY}",
             "--seed", "1", "--no-shrink"],
            capture_output=True, text=True, timeout=FUZZ_SECONDS + 240,
            cwd=tmp_path,  # its .schemathesis/ cache lands there, not in the repository
        )
        report = out.stdout[-6000:] + out.stderr[-2000:]
        (tmp_path / "schemathesis.txt").write_text(out.stdout + out.stderr)
        print(report[-2500:])
        assert proc.poll() is None, "the Explorer died under fuzzing"
        assert http.get("/health").json()["status"] in ("ok", "degraded")
        assert out.returncode == 0, report
        after = {e: http.get(f"/experiences/{e}").json() for e in before}
        assert after == snapshot
    db = buffer.create_buffer_engine(url)
    try:
        assert buffer.count_by_status(engine=db).get("committed", 0) >= 4
    finally:
        db.dispose()
