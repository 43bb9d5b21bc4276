"""Dataset training (rLLM-style): an agent and an environment class trained over a dataset, with a
validation set, by one ``AgentTrainer(...).train()`` call or ``kaizen train --config``.

It uses the online services and nothing else: it starts a real Explorer and a real Trainer (or
connects to an Explorer whose Trainer runs elsewhere), drives every training task ``repeat`` times
through the environment (``runner_sdk.EnvironmentRunner``: a GRPO group per task, episode rewards
sent as feedback and committed), lets the Trainer train and publish as in production, and scores the
validation set on the serving versions every ``eval.every_versions`` new versions (rewards computed,
never sent: validation never becomes training data). It stops at ``eval.target`` or after
``train.epochs``, and writes ``report.json`` and ``val_reward.png`` (validation reward per version)
into its run folder.

    trainer = AgentTrainer(agent=solve, env_class=ParityEnv, train_dataset=train, val_dataset=val,
                           config={"model": {"path": ".cache/tiny-model"}, "train": {"epochs": 2}})
    report = trainer.train()

``agent``: ``async def agent(client, observation) -> action`` (``client``: a ``runner_sdk.AgentClient``
for the first agent; ``client.as_agent(name)`` reaches the others), or a class built with
``agent_args`` whose instances are such callables. ``env_class(task, **env_args)`` follows the
runner SDK's Environment protocol (``reset()``, ``step(action) -> (observation, reward, done, info)``).
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pydantic import Field

from runner_sdk import AdaptiveRepeat, EnvironmentRunner, SyncExplorerClient
from services.common.config import AdaptiveRunsSection, ConfigError, ConfigModel, ModelSection, deep_merge
from services.common.launch import Stack, new_run_dir
from services.common.plugins import load_dataset, load_object

log = logging.getLogger("kaizen.train")


class TrainLoopSection(AdaptiveRunsSection):
    section = "train"

    epochs: int = Field(default=1, ge=1, description="Passes over the training dataset.")
    repeat: int = Field(default=4, ge=1, description="Runs of each training task (a GRPO group).")
    tasks_per_round: int = Field(default=8, ge=1, description="Tasks driven together before the backlog is checked.")
    concurrency: int = Field(default=8, ge=1, description="Episodes in flight at once.")
    max_steps: int = Field(default=8, ge=1, description="Environment steps per episode at most.")
    max_backlog: int = Field(
        default=64, ge=1, description="Committed experiences not yet trained on, per agent, above which a round waits "
        "for the Trainer (keeps the data close to on-policy).")
    backlog_wait_s: float = Field(default=900, gt=0, description="Longest wait for the Trainer before giving up.")
    shuffle: bool = Field(default=True, description="Shuffle the training tasks every epoch (seeded).")


class EvalSection(ConfigModel):
    every_versions: int = Field(default=1, ge=1, description="Score the validation set each time the first agent's "
                                "serving version has moved this many versions.")
    repeat: int = Field(default=1, ge=1, description="Runs of each validation task.")
    target: float | None = Field(default=None, description="Stop once the validation reward reaches this.")


class ServiceSection(ConfigModel):
    url: str | None = Field(default=None, description="explorer: connect to this Explorer (its Trainer runs "
                            "elsewhere); absent: start an Explorer and a Trainer here.")
    config: dict[str, Any] = Field(default_factory=dict, description="Extra keys of the started service's config.")


class TrainJobConfig(ConfigModel):
    model: ModelSection
    agents: list[str] = Field(default_factory=lambda: ["default"], min_length=1,
                              description="The agents (one adapter each); the first is the one `client` talks to.")
    agent: str | None = Field(default=None, description="kaizen train: module:attr of the agent callable or class.")
    agent_args: dict[str, Any] = Field(default_factory=dict, description="Arguments of an agent class.")
    env: str | None = Field(default=None, description="kaizen train: module:attr of the environment class.")
    env_args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of env_class(task, ...).")
    train_dataset: str | None = Field(default=None, description="kaizen train: a .json / .jsonl file of tasks, or "
                                      "module:attr (a list, or a function returning one).")
    val_dataset: str | None = Field(default=None, description="kaizen train: the validation tasks, the same way.")
    train: TrainLoopSection = Field(default_factory=TrainLoopSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    explorer: ServiceSection = Field(default_factory=ServiceSection)
    trainer: ServiceSection = Field(default_factory=ServiceSection)
    run_dir: str = Field(default="runs/train", description="Each job writes into a new timestamped folder here.")
    seed: int = Field(default=0, description="Seed of the task order.")


@dataclass
class TrainReport:
    run_dir: Path
    evals: list[dict[str, Any]] = field(default_factory=list)  # {"versions", "val_reward", "epoch", "round"}
    train_rewards: list[float] = field(default_factory=list)  # mean reward of each training round
    stopped: str = ""  # why it stopped

    @property
    def best(self) -> float | None:
        return max((e["val_reward"] for e in self.evals), default=None)


class AgentTrainer:
    def __init__(self, *, agent: Callable | type, env_class: type, train_dataset: list[Any],
                 val_dataset: list[Any] | None = None, env_args: dict[str, Any] | None = None,
                 agent_args: dict[str, Any] | None = None, config: TrainJobConfig | dict[str, Any] | None = None):
        self.cfg = config if isinstance(config, TrainJobConfig) else TrainJobConfig.model_validate(config or {})
        if not train_dataset:
            raise ConfigError("train_dataset is empty")
        self.agent = agent(**(agent_args or self.cfg.agent_args)) if isinstance(agent, type) else agent
        if not callable(self.agent):
            raise ConfigError("agent must be a callable (client, observation) -> action, or a class of such callables")
        env_args = env_args if env_args is not None else self.cfg.env_args
        self.make_env = lambda task: env_class(task, **env_args)
        self.train_dataset, self.val_dataset = list(train_dataset), list(val_dataset or [])

    # ------------------------------------------------------------------ the services

    def _start(self, run: Path) -> Stack:
        """An Explorer and a Trainer in ``run``. The Trainer's config is checked here (its model loads
        torch, so only when services start); the Explorer's is checked by the Explorer, whose log's
        last lines come with the error if it refuses it."""
        from services.trainer.config import TrainerConfig

        cfg, agents = self.cfg, self.cfg.agents
        stack = Stack(run, agents[0], config_models={"trainer": TrainerConfig})
        model = {"model": cfg.model.model_dump(exclude_none=True)}
        explorer = stack.explorer_config(model, deep_merge({"agents": {"names": agents, "default": agents[0]}}, cfg.explorer.config))
        trainer = stack.trainer_config(model, deep_merge({"trainer": {"agents": agents}}, cfg.trainer.config))
        stack.start(explorer, trainer)
        return stack

    def _versions(self, explorer: SyncExplorerClient) -> dict[str, int]:
        return {m["id"]: int(m.get("version") or 0) for m in explorer.models() if m["id"] in self.cfg.agents}

    def _backlog(self, explorer: SyncExplorerClient, agent: str, limit: int) -> int:
        return len(explorer.experiences(status="committed", agent=agent, limit=min(limit, 1000)))

    def _wait_for_trainer(self, explorer: SyncExplorerClient, stack, *, until: int, settle_s: float | None = None) -> None:
        """Until every agent has at most ``until`` committed experiences waiting (the Trainer trains
        them), or, with ``settle_s``, until the backlog has not moved for that long (what is left is
        less than a batch)."""
        deadline = time.monotonic() + self.cfg.train.backlog_wait_s
        seen, since, pause = None, time.monotonic(), 0.05
        while True:
            backlog = [self._backlog(explorer, a, max(until, 1000) + 1) for a in self.cfg.agents]
            if all(n <= until for n in backlog):
                return
            if backlog != seen:
                seen, since = backlog, time.monotonic()
            elif settle_s is not None and time.monotonic() - since >= settle_s:
                return
            if stack is not None:
                stack.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Trainer left more than {until} committed experiences waiting for "
                                   f"{self.cfg.train.backlog_wait_s:.0f} s; is it running?")
            time.sleep(pause)  # soon at first (a step often takes a second or two), then every half second
            pause = min(pause * 2, 0.5)

    # ------------------------------------------------------------------ the loop

    def _runner(self, url: str, *, repeat: int | AdaptiveRepeat, feedback: bool, prefix: str) -> EnvironmentRunner:
        t = self.cfg.train
        return EnvironmentRunner(endpoint=url, model=self.cfg.agents[0], make_env=self.make_env, agent=self.agent,
                                 repeat=repeat, concurrency=t.concurrency, max_steps=t.max_steps, feedback=feedback,
                                 task_id=lambda task, k: f"{prefix}-{k}-{random.getrandbits(32):08x}", timeout=600)

    def _evaluate(self, explorer: SyncExplorerClient, report: TrainReport, epoch: int, round_: int) -> float:
        versions = self._versions(explorer)
        runner = self._runner(explorer.endpoint, repeat=self.cfg.eval.repeat, feedback=False, prefix="val")
        results = runner.run_sync(self.val_dataset)
        failed = sum(r.error is not None for r in results)
        score = statistics.fmean(r.reward for r in results)
        # every numeric figure the environment reports in `info` (e.g. each agent's share), averaged
        keys = sorted({k for r in results for k, v in r.info.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        info = {k: statistics.fmean(float(r.info.get(k, 0.0)) for r in results) for k in keys}
        report.evals.append({"versions": versions, "val_reward": score, "info": info, "epoch": epoch, "round": round_,
                             "episodes": len(results), "failed": failed})
        log.info("validation at %s: reward %.3f over %d episodes (%d failed)", versions, score, len(results), failed)
        return score

    def train(self) -> TrainReport:
        cfg, t = self.cfg, self.cfg.train
        run = new_run_dir(cfg.run_dir)
        report = TrainReport(run_dir=run)
        stack = None if cfg.explorer.url else self._start(run)
        url = cfg.explorer.url or stack.url
        explorer = SyncExplorerClient(url, timeout=30)
        try:
            last_eval = None
            if self.val_dataset:
                self._evaluate(explorer, report, 0, 0)
                last_eval = self._versions(explorer)[cfg.agents[0]]
            rng = random.Random(cfg.seed)
            round_ = 0
            for epoch in range(1, t.epochs + 1):
                tasks = list(self.train_dataset)
                if t.shuffle:
                    rng.shuffle(tasks)
                for k in range(0, len(tasks), t.tasks_per_round):
                    round_ += 1
                    self._wait_for_trainer(explorer, stack, until=t.max_backlog)
                    results = self._runner(url, repeat=t.adaptive(), feedback=True, prefix=f"train-e{epoch}").run_sync(
                        tasks[k : k + t.tasks_per_round])
                    report.train_rewards.append(statistics.fmean(r.reward for r in results))
                    log.info("epoch %d round %d: train reward %.3f", epoch, round_, report.train_rewards[-1])
                    version = self._versions(explorer)[cfg.agents[0]]
                    if self.val_dataset and version - last_eval >= cfg.eval.every_versions:
                        last_eval = version
                        score = self._evaluate(explorer, report, epoch, round_)
                        if cfg.eval.target is not None and score >= cfg.eval.target:
                            report.stopped = f"validation reward reached the target {cfg.eval.target}"
                            return report
            self._wait_for_trainer(explorer, stack, until=0, settle_s=30)  # the last rounds trained too, before the last score
            if self.val_dataset and self._versions(explorer)[cfg.agents[0]] != last_eval:
                self._evaluate(explorer, report, t.epochs, round_)
            report.stopped = f"{t.epochs} epochs done"
            return report
        finally:
            explorer.close()
            if stack is not None:
                stack.stop()
            self._write(report)

    def _write(self, report: TrainReport) -> None:
        run = report.run_dir
        (run / "report.json").write_text(json.dumps({"evals": report.evals, "train_rewards": report.train_rewards,
                                                     "stopped": report.stopped}, indent=2))
        if not report.evals:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        first = self.cfg.agents[0]
        ax.plot([e["versions"].get(first, 0) for e in report.evals], [e["val_reward"] for e in report.evals], marker="o")
        ax.set_xlabel(f"serving version of {first}")
        ax.set_ylabel("validation reward")
        ax.set_title("validation reward per version")
        fig.tight_layout()
        fig.savefig(run / "val_reward.png", dpi=100)
        plt.close(fig)


def run_train_job(cfg: TrainJobConfig) -> TrainReport:
    """``kaizen train``: the agent, environment and datasets named in the config."""
    missing = [k for k in ("agent", "env", "train_dataset") if getattr(cfg, k) is None]
    if missing:
        raise ConfigError(f"kaizen train needs {', '.join(missing)} in its config (module:attr, or a dataset file)")
    trainer = AgentTrainer(agent=load_object(cfg.agent), env_class=load_object(cfg.env),
                           train_dataset=load_dataset(cfg.train_dataset),
                           val_dataset=load_dataset(cfg.val_dataset) if cfg.val_dataset else None, config=cfg)
    return trainer.train()
