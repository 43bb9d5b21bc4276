"""`kaizen demo` (task=tools, the default): a real pretrained agent gets better at a tool-using job
from its own traffic, on a laptop CPU.

1. builds SmolLM2-135M-Instruct (`kaizen pretrained`) if it is missing; 2. starts a real Explorer
and a real Trainer (services.common.launch.Stack); 3. posts the hand-written demonstrations
(services/demo/tools_task.py, or units_task.py with ``tools.task=units``) to ``POST /demonstrations``: the Trainer's cold start (``algorithm.cold_start_steps`` supervised
steps) runs while the base model is measured on the held-out problems; 4. measures the cold-start
version; 5. the online loop: the agent app (services/demo/agent_app.py, the official `openai`
client with ``tools=[calculator]`` or ``[convert]``) answers traffic problems, a group of runs per task_id, sends each
episode's reward with ``/feedback`` and commits; the Trainer trains GRPO on episodes (plus the
supervised term on the demonstrations) and the Explorer hot-loads every version; 6. stops the
Trainer and measures the last version while, in this process, a control arm trains the cold-start
version for as many steps on the replayed demonstrations alone (``tools.control``); 7. measures the
control arm and, with ``tools.plateau``, trains it on until it stops improving on validation
problems and measures its best version (services/demo/demonstrations_only.py); 8. prints the
held-out scores with their 95% intervals, the gain of each stage, the part GRPO on the traffic gave
(the online loop against its control arm, and against the demonstrations' best) and a plot.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Awaitable, Callable, Literal

from runner_sdk import ExplorerClient
from runner_sdk.groups import run_group
from services.common import buffer, checkpoints
from services.common.config import deep_merge
from services.common.cpus import usable_cpus
from services.common.launch import Stack, new_run_dir
from services.demo import agent_app, tasks
from services.demo.config import DemoConfig
from services.demo.demonstrations_only import DemonstrationsOnly, Plateau
from services.demo.loop import EvalResult, OnlineLoop, Round, demo_stack, gate_section, release_check, say, settle_candidate
from services.demo.report import Stage, report
from services.demo.task import Problem, Task

MODEL_NAME = "smollm2-135m-instruct"
ENGINE_REPLICAS = 4  # the most engine replicas the demo's Explorer runs (one a core, each a copy of the model)
KEPT = "online loop, best on validation"  # the label of the loop's kept version (tools.keep_best), before its steps

# tools.levers: the Trainer's levers for learning from the traffic (docs/TRAINER.md), over the plain settings
LEVERS = {"algorithm": {
    # a group all wrong (or all right) still teaches, against a fixed baseline; the ratio against the Trainer's own
    # policy, the engine's logprobs corrected by truncated importance weights
    "grpo": {"flat_groups": "baseline", "flat_baseline": 0.5, "importance": "truncate", "importance_cap": 2.0},
    # after the cold start the demonstrations are replayed only in proportion to the groups that found no success, at
    # a weight decaying to 0.25 over 8 steps, while the agent's own successes (the best episode of each solved
    # problem) are replayed at a weight growing to 1 over 4 steps: the mixed objective moves from them to the traffic
    "sft_coef_final": 0.25, "sft_decay_steps": 8, "demo_replay": "failed_groups",
    "self_imitation": {"coef": 1.0, "ramp_steps": 4, "batch_size": 8, "per_task": 1},
}}


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a success rate (stays inside [0, 1] and is sane near 0 and 1)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def engine_dtype() -> str:
    """The Explorer's: bfloat16 where the CPU computes it natively (AVX-512 BF16, AMX), else float32. Decoding
    a few sequences reads every weight a token, so half the bytes decode faster even where bfloat16's
    products are not (the decode kernels: docs/ENGINES.md); emulated bfloat16 made a Trainer step about 50x
    slower on an AVX2-only CPU."""
    from services.common.models import cpu_has_native_bf16

    return "bfloat16" if cpu_has_native_bf16() else "float32"


def trainer_dtype() -> str:
    """The Trainer's: bfloat16 only where its products run at least as fast as float32's, measured
    (``cpu_training_dtype``): on a Xeon whose AMX is hidden, bfloat16 products ran 0.56x float32's and a
    step 0.72x, while its engine still decoded 2.1-2.4x faster in bfloat16. The Trainer scores the tokens
    it learns from itself; the gap to the engine's recorded logprobs is corrected by importance weights
    (algorithm.grpo.importance) and reported as ``logprob_mismatch``."""
    from services.common.models import cpu_training_dtype

    return cpu_training_dtype()


def dtype_note(engine: str, trainer: str) -> str:
    """What the demo's start line says of its dtypes and why."""
    from services.common.models import bf16_products_speedup

    speedup = bf16_products_speedup()
    why = (f"bfloat16 products {speedup:.2f}x float32's on this CPU" if speedup else "no native bfloat16 on this CPU")
    return f"the Explorer in {engine}, the Trainer in {trainer} ({why})"


def mean_interval(scores: list[float], z: float = 1.96) -> tuple[float, float]:
    """Normal 95% interval of a mean reward between 0 and 1 (a graded task's), clipped to [0, 1]."""
    n = len(scores)
    if n < 2:
        return 0.0, 1.0
    m, half = statistics.fmean(scores), z * statistics.stdev(scores) / math.sqrt(n)
    return max(0.0, m - half), min(1.0, m + half)


def feedback_calls(ep: agent_app.Episode, task: Task, *, words: Literal["off", "hints", "corrections"] = "off",
                   hint_calls: Literal["episode", "tool"] = "episode", corrects: bool = True,
                   call_credit: float = 0.0) -> list[dict]:
    """The Explorer feedback requests (``ExplorerClient.feedback`` keywords) for one finished episode:
    its reward for every call (with ``call_credit``, at least that much when a tool call of the episode
    computed the answer, half as much when one only had the right form: ``Task.call_grade``); after a wrong answer, with ``words="hints"``, the task's hint on every
    call (``hint_calls="episode"``), or on the first call alone, the tool call the hint speaks about,
    when that call did not compute the answer (``"tool"``); with ``words="corrections"``, the right
    first call as the correction of the episode's first, unless a tool call of the episode computed
    the answer (the final reply went wrong after it, which a correction of the first call does not mend), and
    only if the user ``corrects`` this episode (the one they were served, ``tools.correct_runs``)."""
    if words not in ("off", "hints", "corrections") or hint_calls not in ("episode", "tool"):
        raise ValueError(f"unknown feedback in words: words={words!r}, hint_calls={hint_calls!r}")
    if not ep.msg_ids:
        return []
    value = max(ep.reward, call_credit * task.call_grade(ep.problem, ep.messages)) if call_credit else ep.reward
    reward = {"msg_ids": ep.msg_ids, "reward": value, "task_id": ep.task_id, "run_id": ep.run_id}
    if ep.reward >= 1.0 or words == "off":
        return [reward]
    if words == "hints" and hint_calls == "episode":
        return [reward | {"hint": task.hint(ep.problem)}]
    if words == "hints":
        return [reward] if ep.first_call_right else [reward, {"msg_ids": ep.msg_ids[:1], "hint": task.hint(ep.problem)}]
    if ep.called_tool_right or not corrects:
        return [reward]
    return [reward, {"msg_ids": ep.msg_ids[:1], "correction": task.demonstration_turns(ep.problem)[0]["response"]}]


class ToolsDemo:
    def __init__(self, cfg: DemoConfig, stack: Stack):
        self.cfg = cfg
        self.t = cfg.tools
        self.stack = stack
        self.task = tasks.get(self.t.task)
        self.split = self.task.split(cfg.seed, self.t.traffic_problems, self.t.heldout,
                                     self.t.plateau.validation if self.t.plateau.max_steps or self.t.keep_best else 0)
        self.demos = self.task.demonstrations(self.t.demonstrations, self.t.demonstrated_operations)
        self.shown = {p.template for p in self.task.demonstration_problems(self.t.demonstrated_operations)}
        self.rng = random.Random(cfg.seed + 1)
        self.rounds = 0

    # ------------------------------------------------------------------ configs

    def explorer_config(self) -> dict:
        # bfloat16 where native (engine_dtype); the shared system prompt is prefilled once. One engine replica a core (at most
        # ENGINE_REPLICAS), each on one thread: one engine on two threads ran no faster beside the server's own thread,
        # two replicas side by side run the evaluations and the gate's measurements about 1.7x faster (docs/ENGINES.md)
        base = {"model": {"path": self.cfg.model_path, "dtype": engine_dtype()},
                "engine": {"kind": "hf", "max_batch_size": 32, "torch_threads": 1,
                           "replicas": max(1, min(usable_cpus(), ENGINE_REPLICAS))}}
        if self.t.control or self.t.plateau.max_steps:  # the arm is served beside the agent, from the same checkpoint root
            base["agents"] = {"names": [self.cfg.agent, self.control_agent], "default": self.cfg.agent}
        if self.t.explore_temperature is not None:  # the traffic's calls are exploration runs, sampled hotter
            base.setdefault("agents", {})["exploration_temperature"] = {self.cfg.agent: self.t.explore_temperature}
        if self.cfg.release_check or self.t.gate_every:
            base["release"] = self.gate()
        return self.stack.explorer_config(base, self.cfg.explorer)

    def gate(self) -> dict:
        """The release gate's section: the Explorer's, and the Trainer's with tools.gate_every."""
        problems = "units_gate_problems" if self.t.task == "units" else "gate_problems"
        return gate_section("services.demo.agent_app:GateEnv", f"services.demo.agent_app:{problems}",
                            "services.demo.agent_app:gate_agent", every=self.t.gate_every or 1,
                            rule=self.t.gate_rule, against=self.t.gate_against)

    def trainer_config(self) -> dict:
        tr = self.t.traffic
        base = {
            "model": {"path": self.cfg.model_path, "dtype": trainer_dtype()},
            "algorithm": {"name": "grpo", "kl_metric": False,
                          # flat groups (every run scored alike) set aside, so that each step trains on groups that
                          # carry signal (DAPO's dynamic sampling), at most 16 between two steps so that a loop whose
                          # traffic rarely succeeds still steps: it pays per version, so the loop runs until 24 of them
                          # (config.py; docs/DEMO.md). With hints the flat groups are kept: a hinted call teaches
                          # whatever its group scored (docs/TRAINER.md).
                          "grpo": {"group_size": tr.group_size, "min_group_size": 2, "group_wait_s": 30.0, "small_groups": "batch",
                                   **({"flat_groups": "keep"} if self.t.words == "hints" else
                                      {"flat_groups": "discard", "flat_max_set_aside": 16})},
                          # the cold start: the task's steps (calculator 8, units 4) on 4 demonstrations each (about
                          # 3 s a step); every later step replays 4 too (the mixed objective). With 4 the calculator's
                          # traffic scored all wrong for the loop's first 100-150 s; a longer cold start (16 steps: the
                          # demonstrations' NLL near 0) scored higher at first but left no entropy to explore, and GRPO
                          # then gained nothing.
                          "sft_coef": 1.0, "demo_batch_size": 4, "cold_start_steps": self.task.cold_start_steps},
            "lora": {"r": 16, "alpha": 32},
            "optim": {"lr": 1e-3},
            # calls per step: about two per episode (the tool call, then the answer), of a round's first runs
            "train_batch_size": tr.tasks_per_batch * tr.adaptive().first * 2,
            "staleness": {"max_staleness": 2, "policy": "discard",
                          # steps of one size: its figures were measured so, and on 2 cores a catch-up step several
                          # batches long would let more traffic pile up meanwhile
                          "catch_up_max_rows": 0},
            # 8 sequences per forward/backward; their shared system prompt (about 170 tokens) is computed once.
            # Every core: the loop takes turns (the traffic waits while a step trains, the Trainer while a round
            # runs), so a step has the machine to itself (2 cores: a loop step 14-20 s against 24-28 on one), and a
            # round has it too (the engine's replicas, explorer_config).
            "trainer": {"micro_batch_size": 8, "torch_threads": usable_cpus(), "poll_interval_s": 0.2},
        }
        if self.t.gate_every:  # the loop's versions are candidates, measured every gate_every by the Explorer
            base["release"] = self.gate()
        if self.t.levers:
            base = deep_merge(base, LEVERS)
        if self.t.words == "hints":  # the hinted calls' tokens also learn the teacher's view (self-distillation)
            base = deep_merge(base, {"algorithm": {"level": "token", "grpo": {"hint_coef": self.t.hint_coef}}})
        return self.stack.trainer_config(base, self.cfg.trainer)

    # ------------------------------------------------------------------ stages

    def openai_client(self):
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.stack.url}/v1", api_key="demo", timeout=600, max_retries=0)

    async def post_demonstrations(self) -> None:
        client = ExplorerClient(self.stack.url, timeout=60)
        try:
            for d in self.demos:
                await client.demonstrations(model=self.cfg.agent, **d)
        finally:
            await client.aclose()

    async def evaluate(self, label: str, version: int, agent: str | None = None,
                       problems: list[Problem] | None = None) -> EvalResult:
        """Each held-out problem (or each of ``problems``) once through the Explorer, pinned to
        ``agent@v<version>`` (this demo's agent by default); success rate (a graded task's: mean reward) with
        its 95% interval (Wilson's; for a graded task the normal one, clipped to [0, 1])."""
        agent = agent or self.cfg.agent
        problems = self.split.heldout if problems is None else problems
        t0 = time.monotonic()
        client = self.openai_client()
        sem = asyncio.Semaphore(self.t.eval_concurrency)

        async def one(p: Problem) -> agent_app.Episode:
            async with sem:
                return await agent_app.run_episode(client, p, model=f"{agent}@v{version}", max_turns=self.t.max_turns,
                                                   max_tokens=self.t.max_tokens, temperature=self.t.temperature)

        try:
            episodes = await asyncio.gather(*(one(p) for p in problems))
        finally:
            await client.close()
        failed = [e.error for e in episodes if e.error]
        if failed:
            raise RuntimeError(f"{len(failed)} held-out episodes failed, e.g. {failed[0]}")
        scores = [e.reward for e in episodes]
        low, high = mean_interval(scores) if self.task.graded else wilson(sum(scores), len(scores))
        seconds = time.monotonic() - t0
        tool = statistics.fmean(e.tool_calls > 0 for e in episodes)
        right = statistics.fmean(e.called_tool_right for e in episodes)
        ops = self.t.demonstrated_operations
        shown = [e.reward for e in episodes if e.problem.template in self.shown]
        unseen = [e.reward for e in episodes if e.problem.template not in self.shown]
        op_in = [e.reward for e in episodes if self.task.operation(e.problem) in ops]
        op_out = [e.reward for e in episodes if self.task.operation(e.problem) not in ops]
        nan = float("nan")
        say(f"  {label} (v{version}): {'mean reward' if self.task.graded else 'success'} {statistics.fmean(scores):.2f} [{low:.2f}, {high:.2f}] | called "
            f"{self.task.tool_label} {tool:.0%}, with the right {self.task.arguments_word} {right:.0%} | phrasings shown in demonstrations "
            f"{statistics.fmean(shown) if shown else nan:.2f}, never shown {statistics.fmean(unseen) if unseen else nan:.2f}"
            + (f" | operations {ops} {statistics.fmean(op_in) if op_in else nan:.2f}, never shown "
               f"{statistics.fmean(op_out) if op_out else nan:.2f}" if op_out else "")
            + f" | {len(episodes) / seconds:.2f} episodes/s")
        return EvalResult(label, version, statistics.fmean(scores), low, high, scores, seconds)

    @property
    def control_agent(self) -> str:
        return f"{self.cfg.agent}-sft-only"

    def demonstrations_only(self, trainer_cfg: dict, start_version: int) -> DemonstrationsOnly:
        """The control arm: agent ``<agent>-sft-only`` from ``v<start_version>``, trained on the demonstrations alone,
        on one thread: it trains in this process while the Explorer measures versions on the other core."""
        trainer_cfg = deep_merge(trainer_cfg, {"trainer": {"torch_threads": 1}})
        return DemonstrationsOnly(trainer_cfg, db_url=self.stack.db_url, root=self.stack.root, source=self.cfg.agent,
                                  name=self.control_agent, start_version=start_version, model_path=self.cfg.model_path)

    def wait_for_agent_version(self, agent: str, version: int, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while self.stack.serving(agent)["version"] < version:
            self.stack.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{agent} v{version} not served after {timeout_s:.0f} s")
            time.sleep(0.5)

    def wait_for_version(self, version: int, timeout_s: float = 1800, poll_s: float = 1.0) -> int:
        """Until the Trainer has published ``version`` and the Explorer serves it, or, with the loop behind its
        release gate (tools.gate_every), the gate rejected it and the Explorer serves the version it rolled back to
        (the cold start's last version may be measured worse than the version it began from: the demo goes on from what serves,
        not on waiting for a version that will never serve). Returns the version serving."""
        db = buffer.create_buffer_engine(self.stack.db_url, create_tables=False)
        deadline = time.monotonic() + timeout_s
        try:
            while (serving := self.stack.serving()["version"]) < version:
                if any(d.decision == "rejected" for d in buffer.list_decisions(engine=db, agent=self.cfg.agent, version=version)) \
                        and serving == (checkpoints.read_latest(self.stack.root, self.cfg.agent) or 0):
                    say(f"  v{version} was rejected by the release gate: v{serving} serves, and the demo goes on from it")
                    return serving
                self.stack.check_alive()
                if time.monotonic() > deadline:
                    last = buffer.last_trainer_step(engine=db, agent=self.cfg.agent)
                    raise TimeoutError(f"v{version} not served after {timeout_s:.0f} s (trainer at step {last.step if last else 0})")
                time.sleep(poll_s)
            return serving
        finally:
            db.dispose()

    async def one_round(self, client, explorer: ExplorerClient) -> Round:
        """``tasks_per_batch`` traffic problems, ``repeat`` episodes each (one task_id, run ids 0..repeat-1; with
        traffic.first_runs, first_runs each and more where they disagree or all failed); each episode's reward is
        sent for all its calls, then the round's calls are committed, each problem's group whole."""
        tr = self.t.traffic
        self.rounds += 1
        problems = [self.rng.choice(self.split.traffic) for _ in range(tr.tasks_per_batch)]
        sem = asyncio.Semaphore(tr.concurrency)

        async def episode(k: int, p: Problem, run: int) -> agent_app.Episode:
            async with sem:
                ep = await agent_app.run_episode(client, p, model=self.cfg.agent, task_id=f"r{self.rounds}-q{k}",
                                                 run_id=str(run), max_turns=self.t.max_turns, max_tokens=self.t.max_tokens,
                                                 temperature=self.t.temperature,
                                                 explore=self.t.explore_temperature is not None)
                if ep.error is None:
                    try:
                        corrects = run == 0 or self.t.correct_runs == "all"  # run 0 is the one a user was served
                        for kwargs in feedback_calls(ep, self.task, words=self.t.words, hint_calls=self.t.hint_calls,
                                                     corrects=corrects, call_credit=self.t.call_credit):
                            await explorer.feedback(**kwargs)
                    except Exception as e:  # one lost reward must not stop the traffic
                        ep.error = f"feedback failed: {e}"
                return ep

        repeat = tr.adaptive()  # with traffic.first_runs, a problem's runs come in stages (runner_sdk/groups.py)
        groups = await asyncio.gather(*(run_group(repeat, lambda i, k=k, p=p: episode(k, p, i), reward=lambda e: e.reward,
                                                  failed=lambda e: e.error is not None) for k, p in enumerate(problems)))
        episodes = [e for group in groups for e in group]
        ok = [e for e in episodes if e.error is None]
        ids = [i for e in ok for i in e.msg_ids]
        if ids:
            await explorer.commit(msg_ids=ids)
        return Round(t=0.0, reward=statistics.fmean(e.reward for e in ok) if ok else 0.0, episodes=len(episodes),
                     failed=len(episodes) - len(ok), groups=len(problems))

    async def online_loop(self, start_version: int) -> OnlineLoop:
        client = self.openai_client()
        explorer = ExplorerClient(self.stack.url, timeout=120)
        loop = OnlineLoop(self.cfg, self.stack, start_version=start_version, max_backlog=self.t.traffic.max_backlog,
                          one_round=lambda: self.one_round(client, explorer))
        try:
            await loop.run()
        finally:
            await client.close()
            await explorer.aclose()
        return loop


@dataclass
class Arms:
    """What the demonstrations-only arm gave: its control point, and with ``tools.plateau`` its curve on
    the validation problems and its best version measured on the held-out ones."""

    final: EvalResult
    control: EvalResult | None = None
    best: EvalResult | None = None
    curve: list[dict] = field(default_factory=list)  # {steps, version, validation, train_seconds}
    kept: EvalResult | None = None  # tools.keep_best: the online loop's best version on validation, on the held-out problems
    loop_curve: list[dict] = field(default_factory=list)  # {steps, version, validation}: the online loop's versions


class Validation:
    """Scores on the validation problems, each (agent, version) measured once: the cold start is the
    first point of both the online loop's curve and the demonstrations-only arm's."""

    def __init__(self, demo: ToolsDemo):
        self.demo = demo
        self.scores: dict[tuple[str, int], float] = {}

    async def score(self, label: str, agent: str, version: int) -> float:
        if (agent, version) not in self.scores:
            v = await self.demo.evaluate(label, version, agent=agent, problems=self.demo.split.validation)
            self.scores[agent, version] = v.mean
        return self.scores[agent, version]


async def keep_loop_best(demo: ToolsDemo, cold: EvalResult, final: EvalResult, validation: Validation, out: Arms) -> None:
    """tools.keep_best: the online loop's versions on the validation problems, every ``plateau.every``
    steps from the cold start and its last; the earliest with the highest score (as the arm's best is
    chosen) is the version kept, measured on the held-out problems unless it is the cold start or the last."""
    every, last = demo.t.plateau.every, final.version - cold.version
    picker = Plateau(patience=last + 2)  # no early stop: every point is measured
    for steps in sorted({*range(0, last + 1, every), last}):
        score = await validation.score(f"validation, online loop {steps} steps", demo.cfg.agent, cold.version + steps)
        out.loop_curve.append({"steps": steps, "version": cold.version + steps, "validation": score})
        picker.add(steps, score)
    steps, score = picker.best
    label = f"{KEPT} ({steps} steps)"
    say(f"  the online loop's best on validation: {steps} steps ({score:.2f})"
        + ("" if steps in (0, last) else "; measured on the held-out problems"))
    if steps == last:
        out.kept = replace(final, label=label)
    elif steps == 0:
        out.kept = replace(cold, label=label)
    else:
        out.kept = await demo.evaluate(label, cold.version + steps)


async def loop_end(demo: ToolsDemo, cold: EvalResult, final_version: int) -> EvalResult:
    """The version the online loop ended on, on the held-out problems; when the loop published nothing
    (a demonstrations run's one-second loop, usually) that version is the cold start's, measured
    already: its measurement stands, the same scores (so that version's gain is 0 by construction)."""
    if final_version == cold.version:
        say(f"  after online loop (v{final_version}): the cold start's version, measured above")
        return replace(cold, label="after online loop", seconds=0.0)
    return await demo.evaluate("after online loop", final_version)


async def _final_and_arms(demo: ToolsDemo, trainer_cfg: dict, cold: EvalResult, final_version: int, loop_steps: int,
                          beside: Callable[[], Awaitable[None]] | None = None) -> Arms:
    """The last version on the held-out problems while the demonstrations-only arm trains to as many
    steps as the online loop took (one core each), then ``beside`` (the release check), still while it
    trains; then the control arm; then, with ``tools.plateau``, the arm trained on until it stops
    improving on the validation problems, and its best version."""
    t, start = demo.t, cold.version
    validation = Validation(demo)
    if not (t.control or t.plateau.max_steps):
        out = Arms(await loop_end(demo, cold, final_version))
        if t.keep_best:
            await keep_loop_best(demo, cold, out.final, validation, out)
        if beside:
            await beside()
        return out
    control_steps = loop_steps  # as many as the loop's Trainer took (final_version - start unless a gate rolled back)
    every, top = t.plateau.every, t.plateau.max_steps
    marks = sorted({*range(every, min(control_steps, top) + 1, every), control_steps} - {0})  # published on the way

    # `beside` starts once the arm has built its model: transformers' lazy imports are not safe from two threads at
    # once, and the release check imports the same auto classes and model (a loop that published nothing has no
    # measurement to wait for first); by then they are loaded, and the arm trains on beside it
    settled, failed = threading.Event(), threading.Event()

    def to_control_point() -> DemonstrationsOnly:
        try:
            arm = demo.demonstrations_only(trainer_cfg, start)
        except BaseException:
            failed.set()
            raise
        finally:
            settled.set()
        for m in marks or [0]:  # 0: the loop trained nothing, the arm is the cold start published under its name
            arm.train(start + m - arm.version)
        return arm

    training = asyncio.create_task(asyncio.to_thread(to_control_point))
    out = Arms(await loop_end(demo, cold, final_version))
    if t.keep_best:  # while the arm trains on the other core
        await keep_loop_best(demo, cold, out.final, validation, out)
    if beside:  # the Explorer would wait for the arm otherwise (about 50 s of its 24 steps on the other core)
        await asyncio.to_thread(settled.wait)
        if not failed.is_set():  # else the arm's error, next, not a release check first
            await beside()
    arm = await training
    await asyncio.to_thread(demo.wait_for_agent_version, demo.control_agent, arm.version)
    if t.control:
        out.control = await demo.evaluate("control: demonstrations only", arm.version, agent=demo.control_agent)
    if not top:
        return out

    say(f"- the demonstrations-only arm until it stops improving (at most {top} steps from the cold start, measured every "
        f"{every} on {len(demo.split.validation)} validation problems, patience {t.plateau.patience})")
    plateau = Plateau(t.plateau.patience)

    async def measure(steps: int) -> bool:
        agent = demo.cfg.agent if steps == 0 else demo.control_agent
        score = await validation.score(f"validation, {steps} steps", agent, start + steps)
        out.curve.append({"steps": steps, "version": start + steps, "validation": score,
                          "train_seconds": round(arm.seconds_at[start + steps], 1)})
        return plateau.add(steps, score)

    going = await measure(0)
    for m in (m for m in marks if m % every == 0):
        going = going and await measure(m)
    steps = arm.version - start
    while going and (steps // every + 1) * every <= top:  # on to the next multiple of `every`
        steps = await asyncio.to_thread(arm.train, (steps // every + 1) * every - steps) - start
        await asyncio.to_thread(demo.wait_for_agent_version, demo.control_agent, arm.version)
        going = await measure(steps)
    best_steps, best_score = plateau.best
    label = f"demonstrations only, best ({best_steps} steps)"
    say(f"  best on validation: {best_steps} steps ({best_score:.2f}); measured on the held-out problems")
    if best_steps == 0:
        out.best = replace(cold, label=label)
    elif out.control is not None and best_steps == control_steps:
        out.best = replace(out.control, label=label)
    else:
        out.best = await demo.evaluate(label, start + best_steps, agent=demo.control_agent)
    return out


def run_tools(cfg: DemoConfig) -> int:
    t_start = time.monotonic()
    tool = "a unit converter" if cfg.tools.task == "units" else "a calculator tool"
    say(f"Kaizen demo: a real pretrained agent (SmolLM2-135M-Instruct) learns to use {tool} from its own "
        "traffic (CPU, everything local)")
    from services.common.pretrained import build_pretrained, is_complete

    if not is_complete(cfg.model_path, MODEL_NAME) and not (Path(cfg.model_path) / "config.json").exists():
        say(f"- building {MODEL_NAME} at {cfg.model_path} (once, about 35 s)")
        build_pretrained(MODEL_NAME, cfg.model_path)
    run = new_run_dir(cfg.run_dir)
    stack = demo_stack(run, cfg.agent)
    demo = ToolsDemo(cfg, stack)
    explorer_cfg, trainer_cfg = demo.explorer_config(), demo.trainer_config()
    cold_steps = trainer_cfg["algorithm"]["cold_start_steps"]
    say(f"- run folder: {run}")
    say("- starting the Explorer and the Trainer (separate processes, shared SQLite buffer and checkpoints): "
        + dtype_note(explorer_cfg["model"]["dtype"], trainer_cfg["model"]["dtype"]))
    try:
        stack.start(explorer_cfg, trainer_cfg)
        # One after the other, not side by side: the Trainer's steps take every core (trainer_config), and beside the
        # base model's episodes both ran slower than in turn (the cold start done at 46 s against 36 on one thread).
        say(f"- the base model on {len(demo.split.heldout)} held-out problems (never asked in traffic), one episode each")
        evals = [asyncio.run(demo.evaluate("base model", 0))]
        say(f"- cold start: {len(demo.demos)} hand-written demonstrations ({len(demo.demos) // 2} episodes: the {demo.task.tool_name} call, "
            f"then the answer) posted to /demonstrations; the Trainer trains {cold_steps} supervised steps on them -> v{cold_steps}")
        asyncio.run(demo.post_demonstrations())
        cold_version = demo.wait_for_version(cold_steps)  # the cold start's last version, unless its gate refused it
        say(f"  [{time.monotonic() - t_start:5.0f}s] cold start done")
        evals.append(asyncio.run(demo.evaluate("after cold start", cold_version)))
        tr = cfg.tools.traffic
        until = f", then until traffic was served by {cfg.min_new_versions} new versions (at most {cfg.max_duration_s:.0f}s)" \
            if cfg.min_new_versions else ""
        say(f"- online loop for {cfg.duration_s:.0f}s{until}: the agent app answers traffic problems ({tr.tasks_per_batch} per round, "
            f"{tr.repeat} runs each), rewards each episode and commits; the Trainer trains GRPO on episodes, the Explorer hot-loads")
        loop = asyncio.run(demo.online_loop(cold_version))
        stack.stop("trainer")  # the loop is over: its last version is measured, and the control arm needs the core
        settle_candidate(stack)  # tools.gate_every: the Trainer's last candidate decided, so what serves is the loop's last
        final_version = checkpoints.read_latest(stack.root, stack.agent) or 0  # what serves (the gate may have rolled back)
        # the Trainer's steps since the cold start (a gate's rejection rolls back to an older version: the steps stay taken)
        loop_steps = max(final_version, *checkpoints.list_versions(stack.root, stack.agent)) - cold_steps
        if final_version != cold_steps + loop_steps:
            say(f"  the loop ends on v{final_version}, the version its gate last promoted; its Trainer took {loop_steps} steps")
        if cfg.tools.control:
            say(f"- control arm, beside the last version's measurement{' and the release check' if cfg.release_check else ''}: "
                f"v{cold_version} trained {loop_steps} more steps on the replayed demonstrations alone (no traffic), "
                f"in this process -> {demo.control_agent}")
        after_loop: dict = {}

        async def release_beside_the_arm() -> None:
            after_loop["serving"] = stack.serving()  # the loop's last version, before the gate promotes a candidate
            after_loop["release"] = await asyncio.to_thread(release_check, stack, cfg.model_path) if cfg.release_check else []

        arms = asyncio.run(_final_and_arms(demo, trainer_cfg, evals[1], final_version, loop_steps,
                                           beside=release_beside_the_arm))
        evals.append(arms.final)
        serving, release = after_loop["serving"], after_loop["release"]
        explorer_requests = stack.http_statuses()  # every measurement's requests, the gate suite's too (it asks over HTTP)
    finally:
        stack.stop()
    stages = [
        Stage(evals[0], None),
        Stage(evals[1], "cold start", f"{cold_steps} supervised steps on {len(demo.demos)} demonstrations"),
        Stage(evals[2], "online loop", f"v{cold_version} -> v{final_version}: GRPO on its own traffic"
              + (f" (sampled at temperature {cfg.tools.explore_temperature:g})" if cfg.tools.explore_temperature else "")
              + " plus "
              + ("the levers (its successes replayed, the demonstrations where groups failed; docs/TRAINER.md)"
                 if cfg.tools.levers else "the demonstrations replayed in every step (the mixed objective)")
              + ", same run, through the Explorer"),
    ]
    others = []
    if arms.control is not None:
        others.append(Stage(arms.control, "GRPO on traffic", f"the online loop against its control arm: the same "
                            f"{loop_steps} steps of replayed demonstrations without the traffic"))
    if arms.best is not None:
        others.append(Stage(arms.best, "traffic over best", "the online loop against the best the demonstrations alone reached, "
                            "chosen on validation problems (tools.plateau)"))
    kept, compared = [], []
    if arms.kept is not None:  # tools.keep_best
        kept = [Stage(arms.kept, "keeping the best", "the loop's best version on validation problems against its last")]
        compared.append((evals[2], arms.kept, "keeping the best", kept[0].note))
        if arms.best is not None:
            compared.append((arms.best, arms.kept, "kept over best", "the loop's best against the demonstrations' best, "
                             "each chosen on the validation problems"))
    curves = {"demonstrations only (validation)": arms.curve} if arms.curve else {}
    if arms.loop_curve:
        curves["online loop (validation)"] = arms.loop_curve
    return report(cfg, stack, loop, stages, arms=others, serving=serving, explorer_requests=explorer_requests,
                  seconds=time.monotonic() - t_start, metric="mean reward" if cfg.tools.task == "units" else "success",
                  interval=("1: the number within 1% with its unit, 0.5: without the unit; normal 95% interval, clipped to [0, 1]"
                            if cfg.tools.task == "units" else "share of problems whose final answer is right, Wilson 95% interval"),
                  title=f"SmolLM2-135M-Instruct with {tool}, on CPU", release=release, kept=kept, compared=compared,
                  curves=curves or None)
