"""Which operator the calculator calls carry, by the kind of problem and the version that sampled them:
`python -m tests.bench.operators RUN_FOLDER [--seed N]` on a `kaizen demo` run of the calculator task
(the folder with buffer.db; the seed is read from a `...-seed<N>` folder name above it if not given).

Every first call of an episode (the reply to the user's question alone) is set beside its problem,
found again from the seed (the demo's problems are a prefix of one seeded stream): the operators in
its expression against the one the problem needs. Printed per version of the demo's agent, traffic
(sampled hotter than the client asked) and evaluations (the held-out and validation episodes, at the
client's temperature) apart: how many first calls, how many carried the problem's operator alone,
how many another one (the operator used, by kind), how many called nothing. Read-only; no model is
loaded.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sqlite3
from collections import Counter, defaultdict
from pathlib import Path

from services.demo import tasks
from services.demo.task import Problem

_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "/", ast.Pow: "**", ast.Mod: "%"}


def operators(expression: str) -> str:
    """The operators of an arithmetic expression, in order, "?" when it does not parse."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        return "?"
    return "".join(_OPS.get(type(n.op), "?") for n in ast.walk(tree) if isinstance(n, ast.BinOp))


def first_call(response: dict) -> str | None:
    """The expression of a reply's first calculator call; None for a reply with no call ("?" for a
    call whose arguments are no JSON object with an expression)."""
    calls = response.get("tool_calls") or []
    if not calls:
        return None
    try:
        args = json.loads(calls[0]["function"]["arguments"])
        return str(args["expression"])
    except (ValueError, KeyError, TypeError):
        return "?"


def problems_by_question(seed: int, count: int = 4000) -> dict[str, Problem]:
    task = tasks.get("calculator")
    split = task.split(seed, 0, count)
    return {p.question: p for p in split.heldout}


def tally(rows, by_question: dict[str, Problem], agent: str) -> dict[tuple[int, str], Counter]:
    """(version, "traffic" | "evaluations") -> Counter over the first calls of "right", "no call",
    "garbled" (no JSON expression, or one that does not parse), "unknown problem" (a question not
    among the seed's) and "<needed> as <used>" (the operators used, "a number" for none)."""
    task = tasks.get("calculator")
    out: dict[tuple[int, str], Counter] = defaultdict(Counter)
    for row_agent, version, messages, response, sampling in rows:
        if row_agent != agent:
            continue
        messages = json.loads(messages)
        if len(messages) != 1 or messages[0].get("role") != "user":
            continue  # not a first call
        kind = "evaluations" if (json.loads(sampling) or {}).get("temperature") == 1.0 else "traffic"
        c = out[version, kind]
        p = by_question.get(messages[0]["content"])
        if p is None:
            c["unknown problem"] += 1
            continue
        expression = first_call(json.loads(response))
        need = task.operation(p)
        used = None if expression is None else operators(expression)
        if used is None:
            c["no call"] += 1
        elif "?" in used or expression == "?":
            c["garbled"] += 1
        elif used == need:
            c["right"] += 1
        else:
            c[f"{need} as {used or 'a number'}"] += 1
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="the run folder (with buffer.db)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--agent", default="calculator")
    a = ap.parse_args(argv)
    db_path = next(iter(sorted(a.run.glob("**/buffer.db"))), None)
    if db_path is None:
        ap.error(f"no buffer.db under {a.run}")
    seed = a.seed
    if seed is None:
        found = next((int(m.group(1)) for part in reversed(db_path.parts) if (m := re.search(r"seed(\d+)$", part))), None)
        if found is None:
            ap.error(f"no seed given and no ...-seed<N> folder in {db_path}: pass --seed")
        seed = found
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT agent, model_version, messages, response, sampling FROM experiences ORDER BY seq").fetchall()
    finally:
        db.close()
    counts = tally(rows, problems_by_question(seed), a.agent)
    if not counts:
        ap.error(f"no first call of agent {a.agent!r} in {db_path}")
    print(f"{db_path} (seed {seed}, agent {a.agent}): first calls by version")
    print(f"{'version':>7} {'kind':<11} {'calls':>5} {'right':>6} {'wrong op':>8} {'garbled':>7} {'no call':>7}  "
          "wrong operator: needed as used")
    for (version, kind), c in sorted(counts.items()):
        n = sum(c.values())
        wrong = {k: v for k, v in sorted(c.items()) if " as " in k}
        unknown = f" ({c['unknown problem']} of unknown problems)" if c["unknown problem"] else ""
        print(f"{version:>7} {kind:<11} {n:>5} {c['right'] / n:>6.0%} {sum(wrong.values()):>8} {c['garbled']:>7} "
              f"{c['no call']:>7}  {', '.join(f'{k} {v}' for k, v in wrong.items())}{unknown}")


if __name__ == "__main__":
    main()
