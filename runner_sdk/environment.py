"""Offline / simulated training: drive a dataset of tasks through an agent and an environment.

    class Env:                                     # the Environment protocol
        def reset(self): return observation
        def step(self, action): return observation, reward, done, info

    async def agent(client, observation):          # client: AgentClient on the Explorer
        return await client.complete(observation)

    runner = EnvironmentRunner(endpoint=URL, model="solver", make_env=Env, agent=agent, repeat=4)
    results = runner.run_sync(tasks)               # rewards sent, experiences committed

Each task runs ``repeat`` times as run ids 0..repeat-1 under one task_id, so GRPO gets groups; with
``repeat=AdaptiveRepeat(first=4, full=8, failed=16)`` (runner_sdk/groups.py) a task gets 4 runs first, and more
only where they disagree or all failed, its run ids still 0..n-1. The
episode's reward (the sum of the step rewards) goes to every Explorer call the agent made in it, and
the commit at the end names exactly the calls whose reward went through. In a multi-agent episode
(``client.as_agent(name)``), an environment whose last ``info`` holds ``agent_rewards`` ({agent:
reward}) gives each agent's calls that agent's reward instead of the team's.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol, runtime_checkable

from runner_sdk.client import AgentClient, ExplorerClient
from runner_sdk.context import running
from runner_sdk.feedback import chunks
from runner_sdk.groups import AdaptiveRepeat, run_group
from runner_sdk.records import AgentRun
from runner_sdk.runner import maybe_await

log = logging.getLogger("runner_sdk")


@runtime_checkable
class Environment(Protocol):
    def reset(self) -> Any: ...

    def step(self, action: Any) -> tuple[Any, float, bool, dict]: ...


@dataclass
class EpisodeResult:
    task_id: str
    run_id: str
    task: Any
    reward: float
    steps: int
    msg_ids: list[str] = field(default_factory=list)
    error: str | None = None
    info: dict = field(default_factory=dict)


class EnvironmentRunner:
    def __init__(
        self,
        *,
        endpoint: str,
        model: str,
        make_env: Callable[[Any], Environment],
        agent: Callable[[AgentClient, Any], Any],
        repeat: int | AdaptiveRepeat = 1,
        concurrency: int = 8,
        max_steps: int = 16,
        api_key: str | None = None,
        timeout: float = 120.0,
        commit: bool = True,
        task_id: Callable[[Any, int], str] | None = None,
        feedback: bool = True,
    ):
        self.endpoint = endpoint
        self.model = model
        self.make_env = make_env
        self.agent = agent
        self.repeat = repeat if isinstance(repeat, AdaptiveRepeat) else AdaptiveRepeat.fixed(repeat)
        self.concurrency = concurrency
        self.max_steps = max_steps
        self.api_key = api_key
        self.timeout = timeout
        self.commit = commit and feedback
        self.feedback = feedback  # False: an evaluation (rewards computed and returned, nothing sent)
        self.task_id = task_id or (lambda task, i: f"env-{uuid.uuid4().hex[:12]}")

    async def _episode(self, client: ExplorerClient, task: Any, task_id: str, run_id: str, sem: asyncio.Semaphore) -> EpisodeResult:
        run = AgentRun(task_id=task_id, run_id=run_id, input=task, selected=True)
        result = EpisodeResult(task_id=task_id, run_id=run_id, task=task, reward=0.0, steps=0)
        async with sem:
            with running(run):
                try:
                    env = self.make_env(task)
                    obs = await maybe_await(env.reset())
                    agent_client = AgentClient(client, self.model, self.api_key)
                    for _ in range(self.max_steps):
                        action = await maybe_await(self.agent(agent_client, obs))
                        obs, reward, done, info = await maybe_await(env.step(action))
                        result.reward += float(reward)
                        result.steps += 1
                        result.info = info or {}
                        if done:
                            break
                except Exception as e:
                    result.error = f"{type(e).__name__}: {e}"
                    log.warning("episode %s/%s failed: %s", task_id, run_id, result.error)
        result.msg_ids = list(run.msg_ids)
        if self.feedback and result.error is None and result.msg_ids:
            try:
                per_agent = result.info.get("agent_rewards")
                if isinstance(per_agent, dict) and per_agent:
                    # a multi-agent episode that scores each agent: each agent's calls get its own reward
                    for agent, reward in per_agent.items():
                        await client.episode_feedback(task_id=task_id, run_id=run_id, agent=agent, reward=float(reward),
                                                      source="environment_runner")
                else:
                    await client.feedback(msg_ids=result.msg_ids, reward=result.reward, task_id=task_id, run_id=run_id,
                                          source="environment_runner")
            except Exception as e:  # one lost reward must not stop the dataset
                result.error = f"feedback failed: {e}"
                log.warning("feedback for %s/%s failed: %s", task_id, run_id, e)
        return result

    async def run(self, tasks: Iterable[Any]) -> list[EpisodeResult]:
        client = ExplorerClient(self.endpoint, api_key=self.api_key, timeout=self.timeout)
        sem = asyncio.Semaphore(self.concurrency)
        try:
            per_task = await asyncio.gather(*(
                run_group(self.repeat, lambda i, task=task, tid=self.task_id(task, k): self._episode(client, task, tid, str(i), sem),
                          reward=lambda r: r.reward, failed=lambda r: r.error is not None)
                for k, task in enumerate(tasks)))
            results = [r for runs in per_task for r in runs]
            if self.commit:
                # The episodes without an error are those whose feedback went through: commit those
                # calls, not every rewarded row in the buffer (other runners' and agents' included).
                rewarded = list(dict.fromkeys(i for r in results if r.error is None for i in r.msg_ids))
                for chunk in chunks(rewarded):
                    await client.commit(msg_ids=chunk)
            return list(results)
        finally:
            await client.aclose()

    def run_sync(self, tasks: Iterable[Any]) -> list[EpisodeResult]:
        return asyncio.run(self.run(tasks))
