"""The release gate's evaluations, run in a worker thread against this Explorer's own HTTP API, each
version pinned by name (``agent@vN``). One score per task, in the same order for both versions, so
the gate's test is paired.

- ``run_suite``: a user's environment and dataset through the runner SDK's ``EnvironmentRunner``
  (rewards computed, never sent: evaluation never becomes training data);
- ``replay``: held-out rewarded calls (``release.gate.replay.holdout_share``, never trained on) sent
  again with their recorded messages and tools, each answer scored by the application's own reward
  calculator with the ``expected`` its feedback carried.

Evaluation calls are recorded like any other (task ids under ``release-eval/``), never rewarded.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import statistics
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from sqlalchemy.engine import Engine as DBEngine

from services.common import buffer
from services.common.plugins import load_dataset, load_object
from services.common.records import Experience
from services.common.release import ReplaySection, SuiteSection, held_out

log = logging.getLogger("kaizen.release")


def run_suite(suite: SuiteSection, *, url: str, api_key: str, agent: str, version: int, task_prefix: str) -> list[float]:
    """The mean episode reward of each suite task on ``agent@v<version>`` (an episode that failed
    scores 0; more than half failing means a broken suite, and raises)."""
    from runner_sdk import EnvironmentRunner

    tasks = load_dataset(suite.dataset)[: suite.max_tasks]
    env_class = load_object(suite.env)
    agent_obj = load_object(suite.agent)
    agent_fn = agent_obj(**suite.agent_args) if isinstance(agent_obj, type) else agent_obj
    runner = EnvironmentRunner(
        endpoint=url, model=f"{agent}@v{version}", make_env=lambda task: env_class(task, **suite.env_args), agent=agent_fn,
        repeat=suite.repeat, concurrency=suite.concurrency, max_steps=suite.max_steps, api_key=api_key, feedback=False,
        task_id=lambda task, k: f"{task_prefix}/{k}",
    )
    results = runner.run_sync(tasks)
    failed = [r for r in results if r.error is not None]
    if len(failed) * 2 > len(results):
        raise RuntimeError(f"{len(failed)} of {len(results)} evaluation episodes failed, e.g. {failed[0].error}")
    scores: dict[str, list[float]] = {}
    for r in results:
        scores.setdefault(r.task_id, []).append(0.0 if r.error else float(r.reward))
    return [statistics.fmean(scores[f"{task_prefix}/{k}"]) for k in range(len(tasks))]


def replay_items(db: DBEngine, agent: str, replay: ReplaySection) -> list[Experience]:
    """The most recent held-out rewarded calls of ``agent`` that can be sent again (chat messages)."""
    out: list[Experience] = []
    for e in buffer.recent_rewarded(engine=db, agent=agent, limit=max(400, int(replay.items / max(replay.holdout_share, 1e-3)) * 4)):
        if not held_out(agent, e.task_id or e.experience_id, replay.holdout_share):
            continue
        if any(m.get("role") == "prompt" for m in e.messages):  # a legacy text completion: no chat to replay
            continue
        out.append(e)
        if len(out) >= replay.items:
            break
    return out


def replay(items: list[Experience], replay: ReplaySection, *, url: str, api_key: str, agent: str, version: int,
           task_prefix: str) -> list[float]:
    """Each item's mean reward over ``replay.repeat`` answers of ``agent@v<version>``."""
    from runner_sdk import AgentRun

    calc = load_object(replay.reward)
    if isinstance(calc, type):
        calc = calc()

    def one(k: int, item: Experience, r: int, http: httpx.Client) -> float:
        s = item.sampling or {}
        body: dict[str, Any] = {
            "model": f"{agent}@v{version}", "messages": item.messages, "max_tokens": s.get("max_tokens"),
            "temperature": s.get("temperature"), "top_p": s.get("top_p"),
            "metadata": {"task_id": f"{task_prefix}/{k}", "run_id": str(r)},
        }
        if item.tools:
            body["tools"] = item.tools
        resp = http.post("/v1/chat/completions", json={k: v for k, v in body.items() if v is not None})
        resp.raise_for_status()
        message = resp.json()["choices"][0]["message"]
        user = [m for m in item.messages if m.get("role") == "user"]
        run = AgentRun(task_id=f"{task_prefix}/{k}", run_id=str(r), input=user[-1].get("content") if user else None,
                       expected=(item.feedback or {}).get("expected"), output=message.get("content"),
                       metadata={"messages": item.messages, "response": message})
        score = calc(run)
        if inspect.isawaitable(score):
            score = asyncio.run(_await(score))
        return float(score)

    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {api_key}"}, timeout=600) as http, \
            ThreadPoolExecutor(8) as pool:
        jobs = [[pool.submit(one, k, item, r, http) for r in range(replay.repeat)] for k, item in enumerate(items)]
        return [statistics.fmean(j.result() for j in runs) for runs in jobs]


async def _await(x):
    return await x
