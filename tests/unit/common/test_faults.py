"""Failpoints: the spec syntax, and a process really dying by SIGKILL on the armed arrival."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from services.common.faults import parse_failpoints
from tests.helpers import REPO


def test_parse_failpoints():
    assert parse_failpoints("") == {}
    assert parse_failpoints("a.b@3, c") == {"a.b": 3, "c": 1}
    for bad in ("a@0", "a@x", "@2", "a@"):
        with pytest.raises(ValueError, match="KAIZEN_FAILPOINTS"):
            parse_failpoints(bad)


def _run(spec: str | None) -> subprocess.CompletedProcess:
    code = "from services.common.faults import failpoint\nfor i in range(3):\n    print(i, flush=True)\n    failpoint('x')\n"
    env = {k: v for k, v in os.environ.items() if k != "KAIZEN_FAILPOINTS"}
    if spec is not None:
        env["KAIZEN_FAILPOINTS"] = spec
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_failpoint_kills_on_the_armed_arrival():
    r = _run("x@2")
    assert r.returncode == -signal.SIGKILL and r.stdout.split() == ["0", "1"]


def test_unarmed_failpoints_do_nothing():
    assert _run(None).stdout.split() == ["0", "1", "2"]
    assert _run("y").stdout.split() == ["0", "1", "2"]
