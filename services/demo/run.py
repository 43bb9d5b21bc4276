"""`kaizen demo`: the whole online loop on one laptop CPU, start to finish, with no argument.

    kaizen demo [--config configs/demo.yaml] [task=tools|parity] [dotted.key=value ...]

The tasks: services/demo/tools_demo.py (the default: SmolLM2 learns a calculator tool, or a unit
converter with tools.task=units) and
services/demo/parity_demo.py (the tiny model learns parity; what CI runs). What they share (a real
Explorer and a real Trainer as separate processes on one SQLite buffer and one checkpoint folder in a
fresh run folder, and the online loop that keeps simulated traffic flowing while the Trainer trains
and the Explorer hot-loads) lives in services/demo/loop.py and services/common/launch.py.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from services.common.config import load_config
from services.demo.config import DemoConfig
from services.demo.parity_demo import run_parity
from services.demo.tools_demo import run_tools


def run_demo(config_path: str | None, overrides: list[str]) -> int:
    path = config_path if config_path and Path(config_path).exists() else None
    cfg = load_config(DemoConfig, path, overrides)
    # A SIGTERM unwinds like Ctrl-C, so the Explorer and the Trainer are stopped too (Stack.stop).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if cfg.task == "parity":
        return run_parity(cfg)
    return run_tools(cfg)
