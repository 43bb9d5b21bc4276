"""Real Kaizen processes for one run: a fresh run folder (``new_run_dir``), and an Explorer and a
Trainer started in it as separate processes (``Stack``), as in production. `kaizen demo` and
`AgentTrainer` (`kaizen train`) start theirs here.

    stack = Stack(new_run_dir("runs/demo"), "default", config_models={"explorer": ExplorerConfig})
    stack.start(stack.explorer_config({"model": {"path": path}}, {}), stack.trainer_config({...}, {}))
    try:
        stack.serving()["version"]
    finally:
        stack.stop()
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import httpx
import yaml
from pydantic import BaseModel

from runner_sdk import ExplorerError, SyncExplorerClient
from services.common.config import deep_merge


def new_run_dir(base: str | Path) -> Path:
    """A new folder under ``base`` named by the time (with a suffix if that name is taken)."""
    run = Path(base) / time.strftime("%Y%m%d-%H%M%S")
    n = 0
    while run.exists():
        n += 1
        run = Path(base) / f"{time.strftime('%Y%m%d-%H%M%S')}-{n}"
    run.mkdir(parents=True)
    return run


class Stack:
    """A real Explorer and a real Trainer as subprocesses (`python -m services.cli ...`), sharing
    only a SQLite buffer and a checkpoint folder in the run folder, as in production.

    ``config_models``: the config model of each service (``"explorer"``, ``"trainer"``) whose config
    is checked here, so that a wrong key fails now, naming it, rather than in a subprocess; a service
    without one is checked when it starts (its log's last lines come with the error)."""

    def __init__(self, run: Path, agent: str, *, config_models: Mapping[str, type[BaseModel]] | None = None):
        self.run = run
        self.agent = agent
        self.root = run / "checkpoints"
        self.db_url = f"sqlite:///{run / 'buffer.db'}"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_models = dict(config_models or {})
        self.explorer = SyncExplorerClient(self.url, timeout=10)
        self.procs: dict[str, subprocess.Popen] = {}

    def explorer_config(self, base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
        """``base`` (the caller's settings) over what every stacked Explorer has, then ``extra``."""
        shared = {
            "buffer": {"url": self.db_url},
            "checkpoints": {"root": str(self.root)},
            "server": {"host": "127.0.0.1", "port": self.port, "log_level": "warning"},
            "agents": {"names": [self.agent], "default": self.agent},
            "reload": {"poll_interval_s": 0.25},
        }
        return self._checked("explorer", deep_merge(deep_merge(shared, base), extra))

    def trainer_config(self, base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
        """``base`` over what every stacked Trainer has, then ``extra``."""
        shared = {
            "buffer": {"url": self.db_url},
            "checkpoints": {"root": str(self.root), "keep_versions": 1000},
            "save_interval": 1,
            "trainer": {"run_dir": str(self.run / "trainer"), "agents": [self.agent], "progress": False},
            "log_level": "info",
        }
        return self._checked("trainer", deep_merge(deep_merge(shared, base), extra))

    def _checked(self, service: str, cfg: dict[str, Any]) -> dict[str, Any]:
        if service in self.config_models:
            self.config_models[service].model_validate(cfg)
        return cfg

    def start(self, explorer_cfg: dict[str, Any], trainer_cfg: dict[str, Any], timeout_s: float = 300) -> None:
        """Start both (their configs and logs go into the run folder) and wait until the Explorer answers."""
        for name, cfg in (("explorer", explorer_cfg), ("trainer", trainer_cfg)):
            path = self.run / f"{name}.yaml"
            path.write_text(yaml.safe_dump(cfg, sort_keys=False))
            log = open(self.run / f"{name}.log", "ab")
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            if name == "trainer" and not (cfg.get("ray") or {}).get("address"):
                # The stacked Trainer starts its own Ray. Without an address, ray.init() joins whatever
                # /tmp/ray/ray_current_cluster names, even a cluster that died long ago.
                env.setdefault("RAY_ADDRESS", "local")
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "services.cli", name, "--config", str(path)],
                stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive()
            with contextlib.suppress(httpx.HTTPError, ExplorerError):
                self.explorer.health()
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Explorer did not start within {timeout_s:.0f} s; see {self.run}/explorer.log")
            time.sleep(0.3)

    def check_alive(self) -> None:
        dead = [n for n, p in self.procs.items() if p.poll() is not None]
        if dead:
            log = self.run / f"{dead[0]}.log"
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:]) if log.exists() else ""
            raise RuntimeError(f"a service exited; see {self.run}/explorer.log and trainer.log\n"
                               f"the last lines of {dead[0]}.log:\n{tail}")

    def stop(self, *names: str) -> None:
        """Stop these services (all when none is named: the Trainer first); a stopped one is forgotten."""
        chosen = [n for n in (names or reversed(list(self.procs))) if n in self.procs]
        for n in chosen:
            if self.procs[n].poll() is None:
                self.procs[n].send_signal(signal.SIGTERM)
        for n in chosen:
            try:
                self.procs[n].wait(60)
            except subprocess.TimeoutExpired:
                self.procs[n].kill()
            del self.procs[n]
        if not self.procs:
            self.explorer.close()

    def serving(self, agent: str | None = None) -> dict[str, Any]:
        """An agent's entry in /v1/models (this stack's agent by default): the version it serves and how
        many it has loaded."""
        return next(m for m in self.explorer.models() if m["id"] == (agent or self.agent))

    def http_statuses(self) -> dict[str, dict[str, int]]:
        """The Explorer's own count of the answers it gave, by route and HTTP status (from /metrics)."""
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, dict[str, int]] = {}
        for family in text_string_to_metric_families(self.explorer.metrics()):
            for s in family.samples:
                if s.name == "kaizen_requests_total":
                    out.setdefault(s.labels["route"], {})[s.labels["status"]] = int(s.value)
        return out
