"""The SDK installs alone into a fresh venv (no torch, no transformers) and its example runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.integration


def test_sdk_installs_without_torch_and_runs_the_example(explorer, tmp_path):
    venv = tmp_path / "sdk-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    install = subprocess.run([str(py), "-m", "pip", "install", "--quiet", str(REPO)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    probe = subprocess.run([str(py), "-c", "import importlib.util as u; print(u.find_spec('torch'), u.find_spec('transformers'))"],
                           capture_output=True, text=True, check=True, cwd=tmp_path)
    assert probe.stdout.split() == ["None", "None"]
    run = subprocess.run([str(py), "-m", "runner_sdk.examples.quickstart", explorer.url], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "shadow runs 6, feedback sent 6, committed 6, dropped 0" in run.stdout
    rows = explorer.http.get("/experiences", params={"status": "committed"}).json()["data"]
    assert len(rows) == 6 and {r["run_id"] for r in rows} == {"0", "1"}
