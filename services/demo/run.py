"""`kaizen demo`: the whole online loop on one laptop CPU, start to finish, with no argument.

    kaizen demo [--config configs/demo.yaml] [dotted.key=value ...]

1. builds the tiny model if it is missing; 2. a warm start that teaches the format, not the rule
(see task.warm_start_code), published as v1; 3. a real Explorer and a real Trainer, as separate
processes sharing a SQLite buffer and a checkpoint folder in the run folder, and a simulated agent app (the runner SDK's EnvironmentRunner)
asking "Is N even or odd?"; 4. progress while it runs; 5. a table of held-out reward before and
after, and a plot of reward against time and version in the run folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from runner_sdk import EnvironmentRunner
from services.common import buffer, checkpoints
from services.common.config import load_config
from services.demo import task as parity
from services.demo.config import DemoConfig
from services.explorer.config import ExplorerConfig
from services.trainer.config import TrainerConfig


def say(msg: str) -> None:
    print(msg, flush=True)


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@dataclass
class EvalResult:
    label: str
    version: int
    mean: float
    ci95: float
    per_prompt: list[float] = field(default_factory=list)


class Demo:
    def __init__(self, cfg: DemoConfig, run_dir: Path):
        self.cfg = cfg
        self.run = run_dir
        self.root = run_dir / "checkpoints"
        self.db_url = f"sqlite:///{run_dir / 'buffer.db'}"
        self.start_version = 1 if cfg.warm_start.enabled else 0
        self.split = parity.split(cfg.seed, cfg.task.train_numbers, cfg.task.heldout_numbers, cfg.warm_start.examples)
        self.port = self._free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []
        self.batches: list[dict[str, Any]] = []  # per traffic round: time, mean reward, episodes
        self.failed_requests = 0  # episodes of the simulated traffic that ended in an error
        self.explorer_requests: dict[str, dict[str, int]] = {}  # route -> HTTP status -> count, at the end
        self._extended = False  # the loop went past duration_s (min_new_versions)
        self.t0 = time.monotonic()

    @staticmethod
    def _free_port() -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    # ------------------------------------------------------------------ configs

    def explorer_config(self) -> dict:
        base = {
            "model": {"path": self.cfg.model_path},
            "engine": {"kind": "hf", "max_batch_size": 64, "torch_threads": 1},
            "buffer": {"url": self.db_url},
            "checkpoints": {"root": str(self.root)},
            "server": {"host": "127.0.0.1", "port": self.port, "log_level": "warning"},
            "agents": {"names": [self.cfg.agent], "default": self.cfg.agent},
            "reload": {"poll_interval_s": 0.25},
        }
        merged = _merge(base, self.cfg.explorer)
        ExplorerConfig.model_validate(merged)  # fail now, naming the key, not in a subprocess
        return merged

    def trainer_config(self) -> dict:
        base = {
            "model": {"path": self.cfg.model_path},
            "buffer": {"url": self.db_url},
            "checkpoints": {"root": str(self.root), "keep_versions": 1000},
            "algorithm": {"name": "grpo", "kl_metric": False},
            "lora": {"r": 16, "alpha": 32},
            "optim": {"lr": 1e-3},
            "train_batch_size": self.cfg.traffic.tasks_per_batch * self.cfg.traffic.repeat,
            "save_interval": 1,
            "staleness": {"max_staleness": 4, "policy": "discard"},
            "trainer": {"run_dir": str(self.run / "trainer"), "micro_batch_size": 64, "torch_threads": 1,
                        "agents": [self.cfg.agent], "progress": False},
            "log_level": "info",
        }
        merged = _merge(base, self.cfg.trainer)
        TrainerConfig.model_validate(merged)
        return merged

    # ------------------------------------------------------------------ steps

    def warm_start(self, trainer_cfg: dict) -> None:
        """SFT of a fresh adapter on the no-information code (task.warm_start_code), published as v1 through the normal layout."""
        from services.trainer.batches import Norms, TrainItem
        from services.trainer.learner import LearnerWorker

        ws = self.cfg.warm_start
        cfg = _merge(trainer_cfg, {"algorithm": {"name": "sft", "sft_min_reward": 0.0}, "log_level": "warning",
                                   "optim": {"lr": ws.lr}, "trainer": {"micro_batch_size": 64}})
        worker = LearnerWorker(cfg)
        worker.setup()
        worker.ensure_agent(self.cfg.agent)
        tok = worker.policy.tokenizer
        end = tok.convert_tokens_to_ids("<|im_end|>")
        items = []
        for i, (n, label) in enumerate(self.split.warm_start):
            prompt = tok.apply_chat_template([{"role": "user", "content": parity.question(n)}], add_generation_prompt=True, tokenize=False)
            resp = tok.encode(label, add_special_tokens=False) + [end]
            items.append(TrainItem(experience_id=f"warm-{i}", task_id=None, model_version=0,
                                   prompt_ids=tok.encode(prompt, add_special_tokens=False), response_ids=resp,
                                   old_logprobs=[0.0] * len(resp), reward=1.0, temperature=1.0))
        norms = Norms.of(items)
        for step in range(ws.steps):
            worker.train_step(self.cfg.agent, items, norms, step, 0)
        worker.publish(self.cfg.agent, str(self.root), 1, {
            "step": 0, "algorithm": "warm-start (sft on a last-digit code right for half the digits: no parity information)", "base_model": self.cfg.model_path,
            "examples": len(items), "sft_steps": ws.steps})

    def start_services(self, explorer_cfg: dict, trainer_cfg: dict) -> None:
        for name, cfg in (("explorer", explorer_cfg), ("trainer", trainer_cfg)):
            path = self.run / f"{name}.yaml"
            path.write_text(yaml.safe_dump(cfg, sort_keys=False))
            log = open(self.run / f"{name}.log", "ab")
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "services.cli", name, "--config", str(path)],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}))
        deadline = time.monotonic() + 300
        while True:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"a service exited during start-up; see {self.run}/explorer.log and trainer.log")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError("the Explorer did not start within 300 s")
            time.sleep(0.3)

    def stop_services(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()

    async def evaluate(self, label: str, version: int) -> EvalResult:
        """Held-out questions through the Explorer, pinned to ``version``; mean and 95% CI over prompts."""
        k = self.cfg.task.eval_samples
        sem = asyncio.Semaphore(16)
        async with httpx.AsyncClient(base_url=self.url, timeout=300) as client:

            async def one(n: int) -> float:
                async with sem:
                    r = await client.post("/v1/chat/completions", json={
                        "model": f"{self.cfg.agent}@v{version}", "n": k, "temperature": 1.0,
                        "max_tokens": self.cfg.task.max_tokens,
                        "messages": [{"role": "user", "content": parity.question(n)}]})
                    r.raise_for_status()
                    return statistics.fmean(parity.reward(n, c["message"]["content"]) for c in r.json()["choices"])

            per_prompt = await asyncio.gather(*(one(n) for n in self.split.heldout))
        sd = statistics.pstdev(per_prompt) if len(per_prompt) > 1 else 0.0
        return EvalResult(label, version, statistics.fmean(per_prompt), 1.96 * sd / math.sqrt(len(per_prompt)), list(per_prompt))

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

    def serving(self) -> dict:
        data = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"]
        return next(m for m in data if m["id"] == self.cfg.agent)

    async def traffic(self) -> None:
        """The simulated agent app: rounds of questions through the runner SDK until time is up."""
        tr = self.cfg.traffic

        async def agent(client, observation):
            return await client.complete(observation, max_tokens=self.cfg.task.max_tokens, temperature=1.0)

        runner = EnvironmentRunner(endpoint=self.url, model=self.cfg.agent, make_env=parity.ParityEnv, agent=agent,
                                   repeat=tr.repeat, concurrency=tr.concurrency, task_id=lambda n, i: f"n{n}-{time.time_ns()}")
        db = buffer.create_buffer_engine(self.db_url, create_tables=False)
        rng = __import__("random").Random(self.cfg.seed + 1)
        last_print = 0.0
        try:
            while not self.loop_done(db):
                backlog = buffer.count_by_status(engine=db, agent=self.cfg.agent).get("committed", 0)
                if backlog >= tr.max_backlog:  # the trainer is behind: do not pile up stale data
                    await asyncio.sleep(0.2)
                else:
                    numbers = [rng.choice(self.split.train) for _ in range(tr.tasks_per_batch)]
                    results = await runner.run(numbers)
                    self.failed_requests += sum(1 for r in results if r.error)
                    ok = [r.reward for r in results if r.error is None]
                    self.batches.append({"t": time.monotonic() - self.t0, "reward": statistics.fmean(ok) if ok else 0.0,
                                         "episodes": len(results)})
                if time.monotonic() - last_print >= self.cfg.progress_every_s:
                    last_print = time.monotonic()
                    self.progress(db)
        finally:
            db.dispose()

    def loop_done(self, db) -> bool:
        """duration_s is up and, if min_new_versions asks for it, traffic has seen that many new versions
        (or max_duration_s is up, or a service died)."""
        cfg, elapsed = self.cfg, time.monotonic() - self.t0
        if elapsed < cfg.duration_s:
            return False
        if cfg.min_new_versions == 0 or elapsed >= (cfg.max_duration_s or 4 * cfg.duration_s):
            return True
        if any(p.poll() is not None for p in self.procs):
            return True
        if self.new_versions_served(db) >= cfg.min_new_versions:
            return True
        if not self._extended:
            self._extended = True
            say(f"  (extending the loop until traffic was served by {cfg.min_new_versions} versions after v{self.start_version})")
        return False

    def new_versions_served(self, db) -> int:
        """Distinct versions newer than the start one that served traffic (evaluation requests carry no task id)."""
        return buffer.count_versions_served(engine=db, agent=self.cfg.agent, newer_than=self.start_version)

    def progress(self, db) -> None:
        recent = self.batches[-5:]
        reward = statistics.fmean(b["reward"] for b in recent) if recent else float("nan")
        last = buffer.last_trainer_step(engine=db, agent=self.cfg.agent)
        m = self.serving()
        say(f"  [{time.monotonic() - self.t0:5.0f}s] requests {sum(b['episodes'] for b in self.batches):5d}"
            f" | reward (last rounds) {reward:.2f} | trainer steps {last.step if last else 0:3d}"
            f" | serving v{m['version']} (reloads {m['reloads']}) | failed {self.failed_requests}")


def _new_run_dir(base: str) -> Path:
    run = Path(base) / time.strftime("%Y%m%d-%H%M%S")
    n = 0
    while run.exists():
        n += 1
        run = Path(base) / f"{time.strftime('%Y%m%d-%H%M%S')}-{n}"
    run.mkdir(parents=True)
    return run


def run_demo(config_path: str | None, overrides: list[str]) -> int:
    path = config_path if config_path and Path(config_path).exists() else None
    cfg = load_config(DemoConfig, path, overrides)
    t_start = time.monotonic()
    say("Kaizen demo: an agent that gets smarter with use (tiny model, CPU, everything local)")
    if not (Path(cfg.model_path) / "config.json").exists():
        from services.common.tiny_model import build_tiny_model

        say(f"- building the tiny model at {cfg.model_path}")
        build_tiny_model(cfg.model_path)
    run = _new_run_dir(cfg.run_dir)
    demo = Demo(cfg, run)
    explorer_cfg, trainer_cfg = demo.explorer_config(), demo.trainer_config()
    say(f"- run folder: {run}")
    if cfg.warm_start.enabled:
        say(f"- warm start: {cfg.warm_start.steps} SFT steps on {cfg.warm_start.examples} questions labelled by a code of the "
            "last digit that is WRONG for half the digits (teaches the format and where to look, not the rule) -> v1")
        demo.warm_start(trainer_cfg)
    start_version = demo.start_version
    say("- starting the Explorer and the Trainer (separate processes, shared SQLite buffer and checkpoints)")
    demo.start_services(explorer_cfg, trainer_cfg)
    try:
        say(f"- measuring held-out reward ({len(demo.split.heldout)} questions never asked in traffic, "
            f"{cfg.task.eval_samples} samples each)")
        evals = [asyncio.run(demo.evaluate("base model", 0))]
        if cfg.warm_start.enabled:
            evals.append(asyncio.run(demo.evaluate("after warm start", 1)))
        say(f"- online loop for {cfg.duration_s:.0f}s: simulated users ask, the runner SDK rewards and commits, "
            "the Trainer trains (GRPO), the Explorer hot-loads each new version")
        demo.t0 = time.monotonic()
        asyncio.run(demo.traffic())
        final_version = demo.serving()["version"]
        evals.append(asyncio.run(demo.evaluate("after online loop", final_version)))
        serving = demo.serving()
        demo.explorer_requests = demo.http_statuses()
    finally:
        demo.stop_services()
    from services.demo.report import report

    return report(demo, evals, start_version, serving, time.monotonic() - t_start)
