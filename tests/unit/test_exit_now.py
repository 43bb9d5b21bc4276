"""``services.cli._exit_now``: how a finished Trainer process ends. Without the interpreter's exit
(no exit handler runs), with its code and its output written; through the normal exit while a thread
that is not a daemon still runs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.helpers import REPO

PRELUDE = """
import atexit, logging, logging.handlers, sys, threading, time
from services.cli import _exit_now
atexit.register(lambda: print("exit handler", file=sys.stderr))
# a handler that writes only when it is flushed or closed, as a file handler's buffer would
logging.getLogger().addHandler(logging.handlers.MemoryHandler(100, target=logging.StreamHandler(sys.stderr)))
logging.getLogger().setLevel(logging.INFO)
"""


def _run(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


def test_it_ends_at_once_with_the_code_and_the_output_written():
    r = _run("""
        print("buffered", end="")  # no newline: still in the buffer when the process ends
        logging.getLogger("x").info("logged")
        _exit_now(3)
        print("never")
    """)
    assert r.returncode == 3 and r.stdout == "buffered", r
    assert "logged" in r.stderr and "exit handler" not in r.stderr, r.stderr  # no interpreter exit


def test_a_thread_still_running_is_waited_for(tmp_path: Path):
    done = tmp_path / "done"
    r = _run(f"""
        def work():
            time.sleep(0.5)
            open({str(done)!r}, "w").write("written")
        threading.Thread(target=work).start()
        _exit_now(4)
    """)
    assert r.returncode == 4 and done.read_text() == "written", r.stderr
    assert "exit handler" in r.stderr  # the normal exit
