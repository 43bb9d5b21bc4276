"""The import graph of services/ and runner_sdk/, function-level imports included: no circle
between modules, and the rooms stand only on what their neighbours publish (the dashboard and the
agents import nothing from the Explorer or the demo; the runner SDK imports no service).

Run alone to print the graph's circles: ``python -m tests.unit.test_import_graph``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "runner_sdk")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every project module ``name`` imports, at any depth of its code: inside functions and under
    ``TYPE_CHECKING`` too (a circle an import hides is still a circle). ``from pkg import mod``
    counts as importing ``pkg.mod``."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports_of(m, p, known) for m, p in known.items()}


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted.

    A package's ``__init__`` importing its own submodules is not a circle with them when the
    submodules import the package's siblings directly, which is how this project writes imports;
    an edge from a submodule to its own package's ``__init__`` is counted like any other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    found = circles(graph())
    assert not found, "import circles (function-level imports included):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_rooms_stand_on_common_not_on_neighbours():
    forbidden = {
        "services.dashboard": ("services.explorer", "services.demo", "services.trainer", "services.agents"),
        "services.agents": ("services.explorer", "services.demo"),
        "services.common": ("services.explorer", "services.demo", "services.trainer", "services.agents", "services.dashboard"),
        "runner_sdk": ("services",),
    }
    bad = []
    for mod, deps in graph().items():
        for room, banned in forbidden.items():
            if mod == room or mod.startswith(room + "."):
                bad += [f"{mod} -> {d}" for d in sorted(deps) if any(d == b or d.startswith(b + ".") for b in banned)]
    assert not bad, "imports across rooms:\n" + "\n".join(bad)


if __name__ == "__main__":
    g = graph()
    for c in circles(g):
        print(" <-> ".join(c))
    print(f"{len(g)} modules, {sum(len(v) for v in g.values())} imports, {len(circles(g))} circles")
