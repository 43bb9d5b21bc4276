"""What the tools demo needs of a task (``tools.task``): its one tool, its phrasings, its reward, its
hand-written demonstrations. ``calculator`` (services/demo/tools_task.py) and ``units``
(services/demo/units_task.py) are the two, found by name in services/demo/tasks.py; the demo, the
agent app and the learning bench work on either through this. Pure logic, no I/O.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence


@dataclass(frozen=True)
class Problem:
    """One question, the tool's argument that answers it (``expression``: the calculator's expression,
    the unit converter's arguments as JSON) and its value."""

    question: str
    expression: str
    answer: Any
    template: int = -1  # which phrasing (index into its task's templates)
    task: str = "calculator"


@dataclass(frozen=True)
class Split:
    traffic: list[Problem]  # what the simulated users ask
    heldout: list[Problem]  # never asked in traffic and not among the demonstrations
    validation: list[Problem] = field(default_factory=list)  # apart from both: for choosing a checkpoint


@dataclass(frozen=True)
class Task:
    name: str
    tool: dict[str, Any]  # the one tool's schema, as the client sends it
    operations: str  # the kinds of problem, one character each (tools.demonstrated_operations picks some)
    templates: Sequence[tuple[str, str]]  # (kind, phrasing)
    pool: Sequence[Problem]  # the hand-written demonstration problems, in the order they are picked
    make_problem: Callable[[random.Random, int | None], Problem]
    run_tool_call: Callable[[str, Any], str]  # what the app sends back for one call (never raises)
    score: Callable[[Problem, str | None], float]  # the reward of a final reply
    arguments: Callable[[Problem], dict[str, Any]]  # the right call's arguments
    tool_result: Callable[[Problem], str]  # what the tool returns for the right call
    final_reply: Callable[[Problem], str]  # how the demonstrations state the result
    hint: Callable[[Problem], str]  # what the simulated user says after a wrong answer (tools.words=hints)
    max_tokens: int  # per call: the right tool call with its tags and an end token, and a few to spare
    tool_label: str = "the calculator"  # for the report: "called <tool_label>"
    arguments_word: str = "expression"  # for the report: "with the right <arguments_word>"
    graded: bool = False  # rewards between 0 and 1, not only 0 or 1 (the report's interval is then not Wilson's)
    # whether a call's arguments (a dict) have the right form for the problem though maybe not its value (the
    # calculator: the problem's operators; the unit converter: its two units); tools.call_credit rewards it
    right_form: Callable[[Problem, dict[str, Any]], bool] | None = None
    # the demo's online loop stops at this many seconds (max_duration_s) if 24 versions have not served by then, so the
    # whole `kaizen demo` stays within 15 minutes on 2 cores: the units task's longer calls make its loop and its
    # measurements slower (docs/DEMO.md)
    loop_cap_s: float = 690.0
    # the demo's defaults for the Trainer's cold start (supervised steps on the demonstrations) and for the loop's
    # release gate (tools.gate_every: every Nth version measured; 0: every version serves at once), each the setting
    # measured best for the task (docs/DEMO.md)
    cold_start_steps: int = 4
    gate_every: int = 0

    @property
    def tools(self) -> list[dict[str, Any]]:
        return [self.tool]

    @property
    def tool_name(self) -> str:
        return self.tool["function"]["name"]

    def operation(self, p: Problem) -> str:
        return self.templates[p.template][0]

    def split(self, seed: int, n_traffic: int, n_heldout: int, n_validation: int = 0) -> Split:
        """Distinct problems from a seeded generator; held-out and validation ones never appear in traffic
        or demonstrations. The held-out problems are drawn first, so they depend on the seed and their
        number alone (the learning bench regroups stored scores by them); the validation problems last,
        so the others do not depend on them."""
        rng = random.Random(seed)
        taken = {d.question for d in self.pool}
        problems: list[Problem] = []
        while len(problems) < n_traffic + n_heldout + n_validation:
            p = self.make_problem(rng, None)
            if p.question not in taken:
                taken.add(p.question)
                problems.append(p)
        end = n_heldout + n_traffic
        return Split(traffic=problems[n_heldout:end], heldout=problems[:n_heldout], validation=problems[end:])

    def demonstration_problems(self, operations: str | None = None, episodes: int = 8) -> list[Problem]:
        """``episodes`` problems of the pool whose kind is one of ``operations`` (default: all), as many of each."""
        operations = self.operations if operations is None else operations
        if not operations or set(operations) - set(self.operations):
            raise ValueError(f"operations must be some of {self.operations!r} (task {self.name}), got {operations!r}")
        per = episodes // len(operations)
        out = []
        for op in operations:
            mine = [p for p in self.pool if self.operation(p) == op][:per]
            if len(mine) < per:
                raise ValueError(f"the demonstration pool has {len(mine)} {op!r} problems, {per} asked for")
            out += mine
        return out

    def demonstration_turns(self, p: Problem) -> list[dict[str, Any]]:
        """The two demonstrations of one episode, as ``POST /demonstrations`` bodies without ``model``:
        the first call (the user's question -> the tool call), then the answer after the tool result."""
        user = {"role": "user", "content": p.question}
        call = {"id": "call_demo", "type": "function",
                "function": {"name": self.tool_name, "arguments": json.dumps(self.arguments(p))}}
        assistant_call = {"role": "assistant", "content": None, "tool_calls": [call]}
        tool = {"role": "tool", "tool_call_id": call["id"], "content": self.tool_result(p)}
        return [
            {"messages": [user], "tools": self.tools, "response": assistant_call},
            {"messages": [user, assistant_call, tool], "tools": self.tools,
             "response": {"role": "assistant", "content": self.final_reply(p)}},
        ]

    def demonstrations(self, limit: int = 16, operations: str | None = None) -> list[dict[str, Any]]:
        """At most ``limit`` demonstrations of problems of these ``operations``, whole episodes first (call + answer)."""
        out = [turn for p in self.demonstration_problems(operations) for turn in self.demonstration_turns(p)]
        return out[:limit]

    def called_right(self, p: Problem, messages: list[dict[str, Any]]) -> bool:
        """Whether a tool call of the episode got the right result (for the report)."""
        right = self.tool_result(p)
        return any(m.get("role") == "tool" and m.get("content") == right for m in messages)

    def call_grade(self, p: Problem, messages: list[dict[str, Any]]) -> float:
        """How right the episode's tool calls were, whatever its final reply: 1.0 when one computed the answer,
        0.5 when none did but one had the right form (``right_form``), else 0.0."""
        if self.called_right(p, messages):
            return 1.0
        if self.right_form is None:
            return 0.0
        for m in messages:
            for c in m.get("tool_calls") or ():
                fn = c.get("function") or {}
                arguments = tool_arguments(fn.get("name"), self.tool_name, fn.get("arguments") or {})
                if isinstance(arguments, dict) and self.right_form(p, arguments):
                    return 0.5
        return 0.0


def tool_arguments(name: str, tool: str, arguments: str | dict[str, Any]) -> dict[str, Any] | str:
    """A call of ``name`` to the one tool ``tool``: its arguments as a dict, or the error text the model reads."""
    if name != tool:
        return f"error: unknown tool {name!r}; the only tool is {tool}"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return "error: arguments are not JSON"
    return arguments if isinstance(arguments, dict) else {}  # not an object: the task's own message says what is
