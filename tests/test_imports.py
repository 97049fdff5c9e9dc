"""Imports run one way, down the floors: no module of labkit imports, even lazily or only for
type checking, a module that imports it back, and the lower floors never reach up.

The graph is read from the source (every ``import`` statement anywhere in a module, function
bodies and ``if TYPE_CHECKING:`` blocks included), so a circle hidden in a function is found
too. Importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``: those implicit edges
to a package's own parents are not counted, since every package has them.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import labkit

ROOT = Path(labkit.__file__).parent

# Packages whose modules implement one technique (or a model): they never import the floors
# above them, where techniques are composed, taught or examined.
TECHNIQUES = ("models", "collectives", "ddp", "zero", "tensor_parallel", "pipeline",
              "precision", "activation_checkpoint", "checkpoint", "memory",
              "context_parallel", "experts", "optim")  # fmt: skip
ABOVE = ("labs", "checks", "interview", "viz")


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ["labkit", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the labkit modules its import statements name (``from a import b`` counts
    as ``a.b`` when that is a module, else as ``a``)."""
    mods = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    target = sub if sub in mods else node.module
                    if target in mods:
                        graph[name].add(target)
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in mods}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_circles() -> None:
    graph = import_graph()
    report = [
        " <-> ".join(c) + ": " + "; ".join(f"{a} imports {sorted(graph[a] & set(c))}" for a in c)
        for c in cycles(graph)
    ]
    assert not report, "import circles:\n" + "\n".join(report)


def test_the_cycle_finder_finds_a_circle() -> None:  # negative control
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_techniques_never_import_the_floors_above() -> None:
    graph = import_graph()

    def floor(module: str) -> str:
        return module.split(".")[1] if "." in module else ""

    bad = sorted(
        f"{a} imports {b}"
        for a, targets in graph.items()
        if floor(a) in TECHNIQUES
        for b in targets
        if floor(b) in ABOVE
    )
    assert not bad, "\n".join(bad)
    models = sorted(f"{a} imports {b}" for a, targets in graph.items() if floor(a) == "models"
                    for b in targets if floor(b) != "models")  # fmt: skip
    assert not models, "models must not know about distribution:\n" + "\n".join(models)
