"""Building Kaizen's own C++ kernels for the CPU (the hf engine's decode step, the Trainer's elementwise
layers): torch's extension builder with the machine's C++ compiler, the first time a process asks
(``make install`` builds them ahead), cached by torch under ``TORCH_EXTENSIONS_DIR``. Where they cannot
be built, ``build`` says why and the caller keeps its torch path."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

STALE_LOCK_S = 600  # a build lock older than this was left by a build that was killed: torch would wait on it forever


class Once:
    """``build`` (returning (module or None, why not)) run once per process, on the first ``get``; ``peek``
    gives the module only if it was built already (never builds)."""

    def __init__(self, build: Callable[[], tuple[Any | None, str]]):
        self._build, self._lock, self._result = build, threading.Lock(), None

    def get(self) -> tuple[Any | None, str]:
        with self._lock:
            if self._result is None:
                self._result = self._build()
            return self._result

    def peek(self) -> Any | None:
        result = self._result
        return None if result is None else result[0]


def build(name: str, source: Path, *, cflags: list[str], what: str) -> tuple[Any | None, str]:
    """The built module ``name`` from ``source``, or None and why not (``what`` names the kernels in the log)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory, load as load_extension

        _clear_stale_lock(Path(_get_build_directory(name, verbose=False)) / "lock", what)
        return load_extension(name=name, sources=[str(source)], extra_cflags=cflags, extra_ldflags=["-fopenmp"],
                              verbose=False), ""
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: the caller's torch path still runs
        first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        log.warning("%s: not built (%s: %s); torch's ops run instead", what, type(e).__name__, first)
        return None, f"it could not be built ({type(e).__name__}: {first[:300]})"


def _clear_stale_lock(lock: Path, what: str) -> None:
    """Remove torch's build lock when a killed build left it (torch's builder waits for it to go)."""
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return
    if age > STALE_LOCK_S:
        log.warning("%s: removing a build lock %.0f s old (a build was killed): %s", what, age, lock)
        lock.unlink(missing_ok=True)
