"""Which operator the calculator calls carry, by the kind of problem and the version that sampled them:
`python -m tests.bench.operators RUN_FOLDER [--seed N]` on a `kaizen demo` run of the calculator task
(the folder with buffer.db; the seed is read from a `...-seed<N>` folder name above it if not given).

Every first call of an episode (the reply to the user's question alone) is set beside its problem,
found again from the seed (the demo's problems are a prefix of one seeded stream): the operators in
its expression, as the calculator reads them, against the one the problem needs. Printed per version
of the demo's agent, traffic (the demo's rounds, tasks `r<N>-q<K>`) and evaluations (the held-out and
validation episodes, sent without a task) apart, demonstrations, corrections and the release gate's
episodes left out: how many first calls, how many carried the problem's operator alone, how many
another one (the operators used, by kind), how many a call the calculator refuses, how many called
nothing. Read-only; no model is loaded.
"""

from __future__ import annotations

import argparse
import json
import re
import sqlite3
from collections import Counter, defaultdict
from pathlib import Path

from services.demo import tasks
from services.demo.task import Problem
from services.demo.tools_task import operators


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
    """The first ``count`` problems of the seed's stream, by question: every split the demo makes of this seed
    (held-out, traffic, validation: a prefix of the stream) while it asks fewer."""
    task = tasks.get("calculator")
    split = task.split(seed, 0, count)
    return {p.question: p for p in split.heldout}


_TRAFFIC = re.compile(r"r\d+-q\d+")  # the demo's traffic tasks (services/demo/tools_demo.py one_round)


def kind(task_id: str | None, completion_id: str) -> str | None:
    """"traffic" (a task of the demo's rounds), "evaluations" (a held-out or validation episode: no task), or None
    for what is neither (a demonstration or correction, a release-gate episode)."""
    if completion_id.startswith("demo-"):
        return None
    if task_id is None:
        return "evaluations"
    return "traffic" if _TRAFFIC.fullmatch(task_id) else None


def tally(rows, by_question: dict[str, Problem], agent: str) -> dict[tuple[int, str], Counter]:
    """(version, "traffic" | "evaluations") -> Counter over the first calls of "right", "no call",
    "garbled" (no JSON expression, or one the calculator refuses), "unknown problem" (a question not
    among the seed's) and "<needed> as <used>" (the operators used, left to right, "a number" for none)."""
    task = tasks.get("calculator")
    out: dict[tuple[int, str], Counter] = defaultdict(Counter)
    for row_agent, version, messages, response, task_id, completion_id in rows:
        what = kind(task_id, completion_id)
        if row_agent != agent or what is None:
            continue
        messages = json.loads(messages)
        if len(messages) != 1 or messages[0].get("role") != "user":
            continue  # not a first call
        c = out[version, what]
        p = by_question.get(messages[0]["content"])
        if p is None:
            c["unknown problem"] += 1
            continue
        expression = first_call(json.loads(response))
        need = task.operation(p)
        used = None if expression is None else operators(expression)
        if expression is None:
            c["no call"] += 1
        elif used is None:
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
    found = sorted(a.run.glob("**/buffer.db"))
    if len(found) != 1:
        ap.error(f"{len(found)} buffer.db files under {a.run}: name the folder of one run" if found else f"no buffer.db under {a.run}")
    db_path = found[0]
    seed = a.seed
    if seed is None:
        found = next((int(m.group(1)) for part in reversed(db_path.parts) if (m := re.search(r"seed(\d+)$", part))), None)
        if found is None:
            ap.error(f"no seed given and no ...-seed<N> folder in {db_path}: pass --seed")
        seed = found
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT agent, model_version, messages, response, task_id, completion_id FROM experiences "
                          "ORDER BY seq").fetchall()
    finally:
        db.close()
    counts = tally(rows, problems_by_question(seed), a.agent)
    if not counts:
        ap.error(f"no first call of agent {a.agent!r} in {db_path}")
    if all(c["unknown problem"] == sum(c.values()) for c in counts.values()):
        ap.error(f"no question in {db_path} is one of the calculator's problems of seed {seed}: another seed, or another task")
    print(f"{db_path} (seed {seed}, agent {a.agent}): first calls by version")
    print(f"{'version':>7} {'kind':<11} {'calls':>5} {'right':>6} {'wrong op':>8} {'garbled':>7} {'no call':>7}  "
          "wrong operator: needed as used")
    for (version, kind), c in sorted(counts.items()):
        n = sum(c.values()) - c["unknown problem"]
        if not n:
            continue
        wrong = {k: v for k, v in sorted(c.items()) if " as " in k}
        unknown = f" ({c['unknown problem']} of unknown problems)" if c["unknown problem"] else ""
        print(f"{version:>7} {kind:<11} {n:>5} {c['right'] / n:>6.0%} {sum(wrong.values()):>8} {c['garbled']:>7} "
              f"{c['no call']:>7}  {', '.join(f'{k} {v}' for k, v in wrong.items())}{unknown}")


if __name__ == "__main__":
    main()
