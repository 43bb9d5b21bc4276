"""``services.cli._exit_now``: how a finished Trainer process ends (its code, its output flushed, and
the normal exit while a thread that is not a daemon still runs)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.helpers import REPO


def _run(body: str) -> subprocess.CompletedProcess:
    code = "import sys, threading, time\nfrom services.cli import _exit_now\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_it_ends_with_the_code_and_the_output_written():
    r = _run("""
        import logging
        logging.basicConfig(stream=sys.stderr, level=logging.INFO)
        print("buffered", end="")  # no newline: still in the buffer when the process ends
        logging.getLogger("x").info("logged")
        _exit_now(3)
        print("never")
    """)
    assert r.returncode == 3 and r.stdout == "buffered" and "logged" in r.stderr


def test_a_thread_still_running_is_waited_for(tmp_path: Path):
    done = tmp_path / "done"
    r = _run(f"""
        def work():
            time.sleep(0.5)
            open({str(done)!r}, "w").write("written")
        threading.Thread(target=work).start()
        _exit_now(0)
    """)
    assert r.returncode == 0 and done.read_text() == "written", r.stderr
