"""Failpoints: named places where a fault test kills this process, to hit a crash window exactly.

    KAIZEN_FAILPOINTS=trainer.after_state_saved@3,trainer.after_version_renamed

kills the process with SIGKILL (no cleanup, no flush, exactly what ``kill -9`` does) the 3rd time
it reaches ``failpoint("trainer.after_state_saved")``, or the first time it reaches
``failpoint("trainer.after_version_renamed")``: ``name`` alone means ``name@1``. Counts are per
process. The variable is read once, at import; a malformed one is an error, so a fault test with
a typo fails instead of silently never firing. Unset, ``failpoint`` returns after one truth test.
"""

from __future__ import annotations

import os
import signal

ENV = "KAIZEN_FAILPOINTS"


def parse_failpoints(spec: str) -> dict[str, int]:
    """``"a@3,b"`` -> ``{"a": 3, "b": 1}``: on which arrival each named failpoint fires."""
    armed: dict[str, int] = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        name, at, nth = entry.partition("@")
        if not name or (at and not (nth.isdigit() and int(nth) >= 1)):
            raise ValueError(f"{ENV}: {entry!r} is not NAME or NAME@N with N >= 1")
        armed[name] = int(nth) if at else 1
    return armed


_armed = parse_failpoints(os.environ.get(ENV, ""))
_arrivals: dict[str, int] = {}


def failpoint(name: str) -> None:
    """Kill this process here if ``KAIZEN_FAILPOINTS`` arms ``name`` for this arrival."""
    if not _armed or name not in _armed:
        return
    _arrivals[name] = _arrivals.get(name, 0) + 1
    if _arrivals[name] == _armed[name]:
        os.kill(os.getpid(), signal.SIGKILL)
