"""The demo's agent app: answers a problem through the Explorer with the official `openai` client and
its task's one tool (``tools=[calculator]``, or ``[convert]`` for the units task), running the tool itself.

One episode is every call made under one ``metadata={"task_id", "run_id"}``: call 1 (the model
should call the tool), the app runs the tool and sends a ``role: tool`` result, call 2 (the
model should answer), at most ``max_turns`` calls. The app then scores the final reply (the task's
``score``, services/demo/task.py) and, for traffic, sends that reward with ``/feedback`` naming
every call of the episode; the caller commits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.demo import tasks
from services.demo.task import Problem


@dataclass
class Episode:
    problem: Problem
    task_id: str | None
    run_id: str | None
    msg_ids: list[str] = field(default_factory=list)  # completion ids, one per call
    messages: list[dict[str, Any]] = field(default_factory=list)
    final: str | None = None  # the reply that was not a tool call (None: the turns ran out)
    tool_calls: int = 0
    tool_errors: int = 0
    reward: float = 0.0
    error: str | None = None

    @property
    def called_tool_right(self) -> bool:
        """Whether a tool call of this episode computed the answer (for the report)."""
        return tasks.get(self.problem.task).called_right(self.problem, self.messages)

    @property
    def first_call_right(self) -> bool:
        """Whether the episode's first call was a tool call that computed the answer (its results follow it)."""
        calls = self.messages[1].get("tool_calls") if len(self.messages) > 1 else None
        return bool(calls) and tasks.get(self.problem.task).called_right(self.problem, self.messages[2:2 + len(calls)])


async def run_episode(client, problem: Problem, *, model: str, task_id: str | None = None,
                      run_id: str | None = None, max_turns: int = 3, max_tokens: int = 48,
                      temperature: float = 1.0, explore: bool = False) -> Episode:
    """One episode with ``client`` (an ``openai.AsyncOpenAI`` on the Explorer). Never raises: an
    HTTP error ends the episode with ``error`` set and reward 0. With ``explore`` its calls are
    exploration runs (``metadata.explore``): the Explorer samples them at the agent's exploration
    temperature, if it has one, whatever ``temperature`` says."""
    job = tasks.get(problem.task)
    ep = Episode(problem=problem, task_id=task_id, run_id=run_id)
    ep.messages = [{"role": "user", "content": problem.question}]
    metadata = {"task_id": task_id, "run_id": run_id} if task_id is not None else {}
    if explore:
        metadata["explore"] = "true"
    try:
        for _ in range(max_turns):
            r = await client.chat.completions.create(
                model=model, messages=ep.messages, tools=job.tools, temperature=temperature,
                max_tokens=max_tokens, **({"metadata": metadata} if metadata else {}))
            ep.msg_ids.append(r.id)
            msg = r.choices[0].message
            if not msg.tool_calls:
                ep.final = msg.content or ""
                break
            calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                     for c in msg.tool_calls]
            ep.messages.append({"role": "assistant", "content": msg.content, "tool_calls": calls})
            for c in calls:
                result = job.run_tool_call(c["function"]["name"], c["function"]["arguments"])
                ep.tool_calls += 1
                ep.tool_errors += result.startswith("error")
                ep.messages.append({"role": "tool", "tool_call_id": c["id"], "content": result})
    except Exception as e:  # an unanswered call: the episode scores 0 and is not trained on
        ep.error = f"{type(e).__name__}: {e}"
        return ep
    if ep.final is not None:
        ep.messages.append({"role": "assistant", "content": ep.final})
    ep.reward = job.score(problem, ep.final)
    return ep


# The release gate's suite (the Explorer's release.gate.suite names these): problems of their own
# seed, one greedy episode each, so two versions are compared on the same answers.


def gate_problems(name: str = "calculator") -> list[Problem]:
    import random

    rng = random.Random(1_000_003)
    return [tasks.get(name).make_problem(rng, None) for _ in range(32)]


def units_gate_problems() -> list[Problem]:
    """The units task's suite (tools.task=units)."""
    return gate_problems("units")


class GateEnv:
    """One problem per episode: the observation is the problem, the action the agent's final reply."""

    def __init__(self, problem: Problem):
        self.problem = problem

    def reset(self) -> Problem:
        return self.problem

    def step(self, final: str | None):
        return None, tasks.get(self.problem.task).score(self.problem, final), True, {}


async def gate_agent(client, problem: Problem) -> str | None:
    """The agent app's episode on the version the gate pins (``client.model`` is ``agent@vN``)."""
    openai_client = client.openai()
    try:
        ep = await run_episode(openai_client, problem, model=client.model, temperature=0.0,
                               max_tokens=tasks.get(problem.task).max_tokens)
    finally:
        await openai_client.close()
    if ep.error is not None:
        raise RuntimeError(ep.error)
    return ep.final
