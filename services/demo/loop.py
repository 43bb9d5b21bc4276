"""What both tasks of `kaizen demo` share: their Stack (services.common.launch, with the demo's
config checks), the online loop that keeps simulated traffic flowing while the Trainer trains and the
Explorer hot-loads (``OnlineLoop``), a held-out score (``EvalResult``) and the release check at the end."""

from __future__ import annotations

import asyncio
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

from services.common import buffer, checkpoints
from services.common.launch import Stack
from services.demo.config import DemoConfig
from services.explorer.config import ExplorerConfig
from services.trainer.config import TrainerConfig


def say(msg: str) -> None:
    print(msg, flush=True)


def demo_stack(run: Path, agent: str) -> Stack:
    """The demo's Explorer and Trainer in ``run``; their configs are checked before they start."""
    return Stack(run, agent, config_models={"explorer": ExplorerConfig, "trainer": TrainerConfig})


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


@dataclass
class Round:
    """One round of simulated traffic: its episodes' mean reward."""

    t: float
    reward: float
    episodes: int
    failed: int = 0
    groups: int = 0  # the problems asked (episodes / groups: the runs each got)


class OnlineLoop:
    """Rounds of traffic (``one_round``, the task's) until ``duration_s`` is up, paused while the
    Trainer has a backlog, with a progress line every ``progress_every_s``."""

    def __init__(self, cfg: DemoConfig, stack: Stack, *, start_version: int, max_backlog: int,
                 one_round: Callable[[], Awaitable[Round]]):
        self.cfg = cfg
        self.stack = stack
        self.start_version = start_version
        self.max_backlog = max_backlog
        self.one_round = one_round
        self.rounds: list[Round] = []
        self.t0 = time.monotonic()
        self._extended = False
        self.seconds = 0.0  # the loop's wall time, and the Trainer steps it saw (its speed: rates())
        self.trainer_steps = 0

    @property
    def failed_requests(self) -> int:
        return sum(r.failed for r in self.rounds)

    async def run(self) -> None:
        db = buffer.create_buffer_engine(self.stack.db_url, create_tables=False)
        first = buffer.last_trainer_step(engine=db, agent=self.stack.agent)
        self.t0 = last_print = time.monotonic()
        try:
            while not self.done(db):
                self.stack.check_alive()  # a dead Trainer would leave the traffic paused forever
                if self.backlog_full(db):  # the trainer is behind: no stale pile-up
                    await asyncio.sleep(0.2)
                else:
                    r = await self.one_round()
                    r.t = time.monotonic() - self.t0
                    self.rounds.append(r)
                if time.monotonic() - last_print >= self.cfg.progress_every_s:
                    last_print = time.monotonic()
                    self.progress(db)
            self.seconds = time.monotonic() - self.t0
            last = buffer.last_trainer_step(engine=db, agent=self.stack.agent)
            self.trainer_steps = (last.step if last else 0) - (first.step if first else 0)
            rates = self.rates()
            say(f"  the loop: {rates['episodes']} episodes of {rates['groups']} problems ({rates['runs_per_group']:.1f} runs each) "
                f"in {self.seconds:.0f}s ({rates['episodes_per_s']:.2f} episodes/s), "
                f"{self.trainer_steps} Trainer steps ({rates['trainer_steps_per_min']:.1f} per minute)")
        finally:
            db.dispose()

    def rates(self) -> dict[str, float]:
        episodes, groups = sum(r.episodes for r in self.rounds), sum(r.groups for r in self.rounds)
        minutes = max(self.seconds, 1e-9) / 60
        return {"episodes": episodes, "seconds": self.seconds, "episodes_per_s": episodes / max(self.seconds, 1e-9),
                "trainer_steps": self.trainer_steps, "trainer_steps_per_min": self.trainer_steps / minutes,
                "groups": groups, "runs_per_group": episodes / groups if groups else 0.0}

    def backlog_full(self, db) -> bool:
        """``max_backlog`` rollouts wait for the Trainer. Demonstrations, a correction's included, stay
        committed for good: counted, they would pause the traffic for ever once enough corrections came."""
        waiting = buffer.committed_backlog(engine=db, agents=[self.stack.agent], cap=self.max_backlog)
        return waiting[self.stack.agent] >= self.max_backlog

    def done(self, db) -> bool:
        """duration_s is up and, if min_new_versions asks for it, traffic has seen that many new versions
        (or max_duration_s is up)."""
        cfg, elapsed = self.cfg, time.monotonic() - self.t0
        if elapsed < cfg.duration_s:
            return False
        if cfg.min_new_versions == 0:
            return True
        served = buffer.count_versions_served(engine=db, agent=self.stack.agent, newer_than=self.start_version)
        if served >= cfg.min_new_versions:
            return True
        if elapsed >= cfg.max_duration_s:
            say(f"  (stopping the loop at max_duration_s={cfg.max_duration_s:.0f}s: traffic was served by {served} of the "
                f"{cfg.min_new_versions} versions asked for after v{self.start_version})")
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


def gate_section(env: str, dataset: str, agent: str, every: int = 1, rule: str = "non_inferiority",
                 against: str = "last") -> dict:
    """The demo Explorer's release policy: candidates published by hand (``kaizen publish --candidate``,
    the release check below) go through a gate on this suite; so do the Trainer's when it publishes
    candidates too (tools.gate_every: the same section in its config, ``every`` of them measured), while
    by default it publishes straight to LATEST (release.mode immediate, the online loop as it always ran).
    ``rule`` (tools.gate_rule): non_inferiority with tolerance 0.1, or no_harm with tolerance 0 (rejected only
    when shown worse); ``against`` (tools.gate_against): the version measured against."""
    return {"mode": "gated", "poll_interval_s": 0.5,
            "gate": {"suite": {"env": env, "dataset": dataset, "agent": agent, "concurrency": 16}, "rule": rule,
                     "tolerance": 0.1 if rule == "non_inferiority" else 0.0, "every": every, "against": against}}


def settle_candidate(stack: Stack, timeout_s: float = 600) -> dict | None:
    """The Trainer stopped with a candidate awaiting its release decision (release.mode gated): wait for
    the Explorer's gate to decide it, so that the version serving is the loop's last. Returns the decision."""
    candidate = checkpoints.read_candidate(stack.root, stack.agent)
    if candidate is None or candidate <= (checkpoints.read_latest(stack.root, stack.agent) or 0):
        return None
    decision = _wait_for_decision(stack, candidate, timeout_s)
    say(f"  the Trainer's last candidate, v{candidate}: {decision['decision']} by the gate")
    # a rejection may have rolled the loop back to an older version: the Explorer serves it before anything reads
    # what serves (the release check copies it); the decision is recorded before this replica loads it again
    latest, deadline = checkpoints.read_latest(stack.root, stack.agent) or 0, time.monotonic() + timeout_s
    while stack.serving()["version"] != latest:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the Explorer did not serve v{latest} (LATEST) within {timeout_s:.0f} s")
        time.sleep(0.2)
    return decision


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
    say(f"- release check: two candidates beside v{serving}, decided by the Explorer's gate (a paired t-test on its problems)")
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
        rows = stack.explorer.versions(agent=stack.agent)
        row = next((r for r in rows if r["version"] == version), {})
        final = [d for d in row.get("decisions", []) if d["decision"] in ("promoted", "rejected")]
        if final:
            return final[-1]
        time.sleep(0.5)
    raise TimeoutError(f"the gate did not decide about v{version} within {timeout_s:.0f} s; see {stack.run}/explorer.log")
