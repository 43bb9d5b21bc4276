"""`kaizen demo`: the whole online loop on one laptop CPU, start to finish, with no argument.

    kaizen demo [--config configs/demo.yaml] [task=tools|parity] [dotted.key=value ...]

What both tasks share lives here: a real Explorer and a real Trainer started as separate processes
on one SQLite buffer and one checkpoint folder in a fresh run folder (``Stack``), and the online
loop that keeps simulated traffic flowing while the Trainer trains and the Explorer hot-loads
(``OnlineLoop``). The tasks themselves: services/demo/tools_demo.py (the default: SmolLM2 learns a
calculator tool) and services/demo/parity_demo.py (the tiny model learns parity; what CI runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

import httpx
import yaml

from services.common import buffer, checkpoints
from services.common.config import deep_merge, load_config
from services.demo.config import DemoConfig
from services.explorer.config import ExplorerConfig
from services.trainer.config import TrainerConfig


def say(msg: str) -> None:
    print(msg, flush=True)


def new_run_dir(base: str) -> Path:
    run = Path(base) / time.strftime("%Y%m%d-%H%M%S")
    n = 0
    while run.exists():
        n += 1
        run = Path(base) / f"{time.strftime('%Y%m%d-%H%M%S')}-{n}"
    run.mkdir(parents=True)
    return run


@dataclass
class EvalResult:
    """Held-out score of one version: the mean and its 95% interval [low, high]."""

    label: str
    version: int
    mean: float
    low: float
    high: float
    per_prompt: list[float] = field(default_factory=list)  # one score per held-out question, in a fixed order
    seconds: float = 0.0

    @property
    def ci95(self) -> float:
        """Half the width of the interval (symmetric intervals print as mean ± ci95)."""
        return (self.high - self.low) / 2


class Stack:
    """A real Explorer and a real Trainer as subprocesses (`python -m services.cli ...`), sharing
    only a SQLite buffer and a checkpoint folder in the run folder, as in production."""

    def __init__(self, run: Path, agent: str):
        self.run = run
        self.agent = agent
        self.root = run / "checkpoints"
        self.db_url = f"sqlite:///{run / 'buffer.db'}"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen] = {}

    def explorer_config(self, base: dict, extra: dict) -> dict:
        """``base`` (the task's settings) over what every demo Explorer has, then ``extra``; validated."""
        shared = {
            "buffer": {"url": self.db_url},
            "checkpoints": {"root": str(self.root)},
            "server": {"host": "127.0.0.1", "port": self.port, "log_level": "warning"},
            "agents": {"names": [self.agent], "default": self.agent},
            "reload": {"poll_interval_s": 0.25},
        }
        cfg = deep_merge(deep_merge(shared, base), extra)
        ExplorerConfig.model_validate(cfg)  # fail now, naming the key, not in a subprocess
        return cfg

    def trainer_config(self, base: dict, extra: dict) -> dict:
        shared = {
            "buffer": {"url": self.db_url},
            "checkpoints": {"root": str(self.root), "keep_versions": 1000},
            "save_interval": 1,
            "trainer": {"run_dir": str(self.run / "trainer"), "agents": [self.agent], "progress": False},
            "log_level": "info",
        }
        cfg = deep_merge(deep_merge(shared, base), extra)
        TrainerConfig.model_validate(cfg)
        return cfg

    def start(self, explorer_cfg: dict, trainer_cfg: dict, timeout_s: float = 300) -> None:
        for name, cfg in (("explorer", explorer_cfg), ("trainer", trainer_cfg)):
            path = self.run / f"{name}.yaml"
            path.write_text(yaml.safe_dump(cfg, sort_keys=False))
            log = open(self.run / f"{name}.log", "ab")
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            if name == "trainer" and not (cfg.get("ray") or {}).get("address"):
                # The demo's Trainer starts its own Ray. Without an address, ray.init() joins whatever
                # /tmp/ray/ray_current_cluster names, even a cluster that died long ago.
                env.setdefault("RAY_ADDRESS", "local")
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "services.cli", name, "--config", str(path)],
                stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Explorer did not start within {timeout_s:.0f} s; see {self.run}/explorer.log")
            time.sleep(0.3)

    def check_alive(self) -> None:
        if any(p.poll() is not None for p in self.procs.values()):
            raise RuntimeError(f"a service exited; see {self.run}/explorer.log and trainer.log")

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

    def serving(self, agent: str | None = None) -> dict:
        """An agent's entry in /v1/models (this stack's agent by default): the version it serves and how
        many it has loaded."""
        data = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"]
        return next(m for m in data if m["id"] == (agent or self.agent))

    def http_statuses(self) -> dict[str, dict[str, int]]:
        """The Explorer's own count of the answers it gave, by route and HTTP status (from /metrics)."""
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, dict[str, int]] = {}
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "kaizen_requests_total":
                    out.setdefault(s.labels["route"], {})[s.labels["status"]] = int(s.value)
        return out


@dataclass
class Round:
    """One round of simulated traffic: its episodes' mean reward."""

    t: float
    reward: float
    episodes: int
    failed: int = 0


class OnlineLoop:
    """Rounds of traffic (``one_round``, the task's) until ``duration_s`` is up, paused while the
    Trainer has a backlog, with a progress line every ``progress_every_s``."""

    def __init__(self, cfg: DemoConfig, stack: Stack, *, start_version: int, max_backlog: int,
                 one_round: Callable[[], Awaitable[Round]], baseline_committed: int = 0):
        self.cfg = cfg
        self.stack = stack
        self.start_version = start_version
        self.max_backlog = max_backlog
        self.one_round = one_round
        self.baseline_committed = baseline_committed  # committed rows that never leave (demonstrations)
        self.rounds: list[Round] = []
        self.t0 = time.monotonic()
        self._extended = False

    @property
    def failed_requests(self) -> int:
        return sum(r.failed for r in self.rounds)

    async def run(self) -> None:
        db = buffer.create_buffer_engine(self.stack.db_url, create_tables=False)
        self.t0 = last_print = time.monotonic()
        try:
            while not self.done(db):
                self.stack.check_alive()  # a dead Trainer would leave the traffic paused forever
                committed = buffer.count_by_status(engine=db, agent=self.stack.agent).get("committed", 0)
                if committed - self.baseline_committed >= self.max_backlog:  # the trainer is behind: no stale pile-up
                    await asyncio.sleep(0.2)
                else:
                    r = await self.one_round()
                    r.t = time.monotonic() - self.t0
                    self.rounds.append(r)
                if time.monotonic() - last_print >= self.cfg.progress_every_s:
                    last_print = time.monotonic()
                    self.progress(db)
        finally:
            db.dispose()

    def done(self, db) -> bool:
        """duration_s is up and, if min_new_versions asks for it, traffic has seen that many new versions
        (or max_duration_s is up)."""
        cfg, elapsed = self.cfg, time.monotonic() - self.t0
        if elapsed < cfg.duration_s:
            return False
        if cfg.min_new_versions == 0 or elapsed >= (cfg.max_duration_s or 4 * cfg.duration_s):
            return True
        served = buffer.count_versions_served(engine=db, agent=self.stack.agent, newer_than=self.start_version)
        if served >= cfg.min_new_versions:
            return True
        if not self._extended:
            self._extended = True
            say(f"  (extending the loop until traffic was served by {cfg.min_new_versions} versions after v{self.start_version})")
        return False

    def progress(self, db) -> None:
        recent = self.rounds[-5:]
        reward = statistics.fmean(r.reward for r in recent) if recent else float("nan")
        last = buffer.last_trainer_step(engine=db, agent=self.stack.agent)
        m = self.stack.serving()
        say(f"  [{time.monotonic() - self.t0:5.0f}s] episodes {sum(r.episodes for r in self.rounds):5d}"
            f" | reward (last rounds) {reward:.2f} | trainer steps {last.step if last else 0:3d}"
            f" | serving v{m['version']} (reloads {m['reloads']}) | failed {self.failed_requests}")


def gate_section(env: str, dataset: str, agent: str) -> dict:
    """The demo Explorer's release policy: its Trainer publishes straight to LATEST (release.mode
    immediate, the online loop as it always ran), while candidates published by hand (``kaizen
    publish --candidate``, the release check below) go through a gate on this suite."""
    return {"mode": "gated", "poll_interval_s": 0.5,
            "gate": {"suite": {"env": env, "dataset": dataset, "agent": agent, "concurrency": 16}, "tolerance": 0.1}}


def release_check(stack: Stack, model_path: str, timeout_s: float = 600) -> list[dict]:
    """The release gate at work, once the Trainer is stopped: two candidates are published as ``kaizen
    publish --candidate`` would, a deliberately broken copy of the serving adapter (its LoRA B
    weights negated and scaled by 4) and an exact copy; the Explorer's gate scores each against the
    serving version on the gate suite (one-sided paired t-test) and promotes or rejects it. One line
    per decision; returns the decisions."""
    from safetensors.torch import load_file, save_file

    from services.common.publish import publish_adapter

    serving = stack.serving()["version"]
    if serving == 0:
        say("- release check skipped: the base model serves (no adapter to copy)")
        return []
    say(f"- release check: two candidates beside v{serving}, decided by the Explorer's gate (paired t-test, tolerance 0.1)")
    src = checkpoints.version_dir(stack.root, stack.agent, serving)
    decisions = []
    for name, label, scale in (("broken", "a deliberately broken copy", -4.0), ("copy", "an exact copy", 1.0)):
        d = stack.run / f"candidate-{name}"
        d.mkdir(exist_ok=True)
        shutil.copyfile(src / "adapter_config.json", d / "adapter_config.json")
        weights = load_file(str(src / "adapter_model.safetensors"))
        save_file({k: v * scale if "lora_B" in k else v for k, v in weights.items()}, str(d / "adapter_model.safetensors"))
        version = publish_adapter(d, agent=stack.agent, checkpoints_root=stack.root, base_model=model_path, candidate=True,
                                  note=f"demo release check: {label} of v{serving}").version
        decision = _wait_for_decision(stack, version, timeout_s)
        say(f"  gate: v{version} ({label} of v{serving}) {decision['decision']}: {decision['reason']}")
        decisions.append({"candidate": label, **decision})
    return decisions


def _wait_for_decision(stack: Stack, version: int, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stack.check_alive()
        rows = httpx.get(f"{stack.url}/versions", params={"agent": stack.agent}, timeout=10).json()["data"]
        row = next((r for r in rows if r["version"] == version), {})
        final = [d for d in row.get("decisions", []) if d["decision"] in ("promoted", "rejected")]
        if final:
            return final[-1]
        time.sleep(0.5)
    raise TimeoutError(f"the gate did not decide about v{version} within {timeout_s:.0f} s; see {stack.run}/explorer.log")


def run_demo(config_path: str | None, overrides: list[str]) -> int:
    path = config_path if config_path and Path(config_path).exists() else None
    cfg = load_config(DemoConfig, path, overrides)
    # A SIGTERM unwinds like Ctrl-C, so the Explorer and the Trainer are stopped too (Stack.stop).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if cfg.task == "parity":
        from services.demo.parity_demo import run_parity

        return run_parity(cfg)
    from services.demo.tools_demo import run_tools

    return run_tools(cfg)
