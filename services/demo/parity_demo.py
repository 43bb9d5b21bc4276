"""`kaizen demo task=parity`: the tiny random model learns "Is N even or odd?" (fast; what CI runs).

1. builds the tiny model if it is missing; 2. a warm start that teaches the format, not the rule
(see parity_task.warm_start_code), published as v1; 3. a real Explorer and a real Trainer
(services.common.launch.Stack) and a simulated agent app (the runner SDK's EnvironmentRunner) asking
"Is N even or odd?"; 4. progress while it runs; 5. a table of held-out reward before and after, and a plot.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time

from runner_sdk import EnvironmentRunner, ExplorerClient
from services.common.config import deep_merge
from services.common.launch import Stack, new_run_dir
from services.demo import parity_task
from services.demo.config import DemoConfig
from services.demo.loop import EvalResult, OnlineLoop, Round, demo_stack, gate_section, release_check, say
from services.demo.report import Stage, report


class ParityDemo:
    def __init__(self, cfg: DemoConfig, stack: Stack):
        self.cfg = cfg
        self.p = cfg.parity
        self.stack = stack
        self.start_version = 1 if self.p.warm_start.enabled else 0
        self.split = parity_task.split(cfg.seed, self.p.train_numbers, self.p.heldout_numbers, self.p.warm_start.examples)
        self.rng = random.Random(cfg.seed + 1)

    def explorer_config(self) -> dict:
        base = {"model": {"path": self.cfg.model_path}, "engine": {"kind": "hf", "max_batch_size": 64, "torch_threads": 1}}
        if self.cfg.release_check:
            base["release"] = gate_section("services.demo.parity_task:ParityEnv", "services.demo.parity_task:gate_numbers",
                                           "services.demo.parity_task:gate_agent")
        return self.stack.explorer_config(base, self.cfg.explorer)

    def trainer_config(self) -> dict:
        tr = self.p.traffic
        base = {
            "model": {"path": self.cfg.model_path},
            "algorithm": {"name": "grpo", "kl_metric": False},
            "lora": {"r": 16, "alpha": 32},
            "optim": {"lr": 1e-3},
            "train_batch_size": tr.tasks_per_batch * tr.adaptive().first,
            "staleness": {"max_staleness": 4, "policy": "discard",
                          # steps of one size: its figures were measured so, and on 2 cores a catch-up step several
                          # batches long would let more traffic pile up meanwhile
                          "catch_up_max_rows": 0},
            "trainer": {"micro_batch_size": 64, "torch_threads": 1},
        }
        return self.stack.trainer_config(base, self.cfg.trainer)

    def warm_start(self, trainer_cfg: dict) -> None:
        """SFT of a fresh adapter on the no-information code (parity_task.warm_start_code), published as v1 through the normal layout."""
        from services.trainer.batches import Norms, TrainItem
        from services.trainer.learner import LearnerWorker

        ws = self.p.warm_start
        cfg = deep_merge(trainer_cfg, {"algorithm": {"name": "rft", "rft": {"min_reward": 0.0}}, "log_level": "warning",
                                  "optim": {"lr": ws.lr}, "trainer": {"micro_batch_size": 64}})
        worker = LearnerWorker(cfg)
        worker.setup()
        worker.ensure_agent(self.cfg.agent)
        tok = worker.policy.tokenizer
        end = tok.convert_tokens_to_ids("<|im_end|>")
        items = []
        for i, (n, label) in enumerate(self.split.warm_start):
            prompt = tok.apply_chat_template([{"role": "user", "content": parity_task.question(n)}], add_generation_prompt=True, tokenize=False)
            resp = tok.encode(label, add_special_tokens=False) + [end]
            items.append(TrainItem(experience_id=f"warm-{i}", task_id=None, model_version=0,
                                   prompt_ids=tok.encode(prompt, add_special_tokens=False), response_ids=resp,
                                   old_logprobs=[0.0] * len(resp), reward=1.0, temperature=1.0))
        norms = Norms.of(items)
        for step in range(ws.steps):
            worker.train_step(self.cfg.agent, items, norms, step, 0)
        worker.publish(self.cfg.agent, str(self.stack.root), 1, {
            "step": 0, "algorithm": "warm-start (sft on a last-digit code right for half the digits: no parity information)",
            "base_model": self.cfg.model_path, "examples": len(items), "sft_steps": ws.steps})

    async def evaluate(self, label: str, version: int) -> EvalResult:
        """Held-out questions through the Explorer, pinned to ``version``; mean and 95% CI over prompts."""
        k = self.p.eval_samples
        sem = asyncio.Semaphore(16)
        async with ExplorerClient(self.stack.url, timeout=300) as client:

            async def one(n: int) -> float:
                async with sem:
                    r = await client.chat_completions(
                        model=f"{self.cfg.agent}@v{version}", n=k, temperature=1.0, max_tokens=self.p.max_tokens,
                        messages=[{"role": "user", "content": parity_task.question(n)}])
                    return statistics.fmean(parity_task.reward(n, c["message"]["content"]) for c in r["choices"])

            per_prompt = await asyncio.gather(*(one(n) for n in self.split.heldout))
        mean = statistics.fmean(per_prompt)
        half = 1.96 * (statistics.pstdev(per_prompt) if len(per_prompt) > 1 else 0.0) / math.sqrt(len(per_prompt))
        return EvalResult(label, version, mean, mean - half, mean + half, list(per_prompt))

    def round_runner(self) -> EnvironmentRunner:
        tr = self.p.traffic

        async def agent(client, observation):
            return await client.complete(observation, max_tokens=self.p.max_tokens, temperature=1.0)

        return EnvironmentRunner(endpoint=self.stack.url, model=self.cfg.agent, make_env=parity_task.ParityEnv, agent=agent,
                                 repeat=tr.adaptive(), concurrency=tr.concurrency, task_id=lambda n, i: f"n{n}-{time.time_ns()}")

    async def one_round(self, runner: EnvironmentRunner) -> Round:
        numbers = [self.rng.choice(self.split.train) for _ in range(self.p.traffic.tasks_per_batch)]
        results = await runner.run(numbers)
        ok = [r.reward for r in results if r.error is None]
        return Round(t=0.0, reward=statistics.fmean(ok) if ok else 0.0, episodes=len(results),
                     failed=sum(1 for r in results if r.error), groups=len(numbers))


def run_parity(cfg: DemoConfig) -> int:
    from pathlib import Path

    t_start = time.monotonic()
    say("Kaizen demo: an agent that gets smarter with use (tiny model, CPU, everything local)")
    if not (Path(cfg.model_path) / "config.json").exists():
        from services.common.tiny_model import build_tiny_model

        say(f"- building the tiny model at {cfg.model_path}")
        build_tiny_model(cfg.model_path)
    run = new_run_dir(cfg.run_dir)
    stack = demo_stack(run, cfg.agent)
    demo = ParityDemo(cfg, stack)
    explorer_cfg, trainer_cfg = demo.explorer_config(), demo.trainer_config()
    ws = cfg.parity.warm_start
    say(f"- run folder: {run}")
    if ws.enabled:
        say(f"- warm start: {ws.steps} SFT steps on {ws.examples} questions labelled by a code of the "
            "last digit that is WRONG for half the digits (teaches the format and where to look, not the rule) -> v1")
        demo.warm_start(trainer_cfg)
    say("- starting the Explorer and the Trainer (separate processes, shared SQLite buffer and checkpoints)")
    try:
        stack.start(explorer_cfg, trainer_cfg)
        say(f"- measuring held-out reward ({len(demo.split.heldout)} questions never asked in traffic, "
            f"{cfg.parity.eval_samples} samples each)")
        evals = [asyncio.run(demo.evaluate("base model", 0))]
        if ws.enabled:
            evals.append(asyncio.run(demo.evaluate("after warm start", 1)))
        say(f"- online loop for {cfg.duration_s:.0f}s: simulated users ask, the runner SDK rewards and commits, "
            "the Trainer trains (GRPO), the Explorer hot-loads each new version")
        runner = demo.round_runner()
        loop = OnlineLoop(cfg, stack, start_version=demo.start_version, max_backlog=cfg.parity.traffic.max_backlog,
                          one_round=lambda: demo.one_round(runner))
        asyncio.run(loop.run())
        final_version = stack.serving()["version"]
        evals.append(asyncio.run(demo.evaluate("after online loop", final_version)))
        serving = stack.serving()
        explorer_requests = stack.http_statuses()
        stack.stop("trainer")
        release = release_check(stack, cfg.model_path) if cfg.release_check else []
    finally:
        stack.stop()
    stages = [Stage(evals[0], None)]
    if ws.enabled:
        stages.append(Stage(evals[1], "warm start", "supervised on a last-digit code that is right for half the digits"))
    stages.append(Stage(evals[-1], "online loop", f"v{demo.start_version} -> v{evals[-1].version}, same run, measured through the Explorer"))
    return report(cfg, stack, loop, stages, serving=serving, explorer_requests=explorer_requests,
                  seconds=time.monotonic() - t_start, metric="reward", interval="mean ± 95% CI over questions",
                  title="tiny model on CPU", release=release)
