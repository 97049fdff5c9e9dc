#!/usr/bin/env python3
"""Generate exercises/ from solutions/: the solution notebooks are the only source of truth.

In a solution's code cell, the lines the learner must write are fenced::

    def ring_all_gather(output, shard, group=None):
        ### BEGIN SOLUTION  (optional hint, kept as a comment)
        ...the reference code...
        ### END SOLUTION

Each fenced region becomes, at the fence's indentation::

        # YOUR CODE HERE  (optional hint, kept as a comment)
        raise NotImplementedError("exercise: ...")

Usage:
    python tools/make_exercises.py          # (re)write exercises/*.ipynb
    python tools/make_exercises.py --check  # exit 1: an exercise is stale or a notebook has outputs

``--check`` also holds every code cell line of notebooks/, solutions/ and exercises/ to the
line length ruff holds the package to (MAX_LINE), so a cell never runs off the page.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS, EXERCISES = ROOT / "solutions", ROOT / "exercises"
NOTEBOOK_DIRS = ("notebooks", "solutions", "exercises")
BEGIN = re.compile(r"^(?P<indent>\s*)### BEGIN SOLUTION\s*(?P<hint>.*)$")
END = re.compile(r"^\s*### END SOLUTION\s*$")
KEEP_OUTPUT_TAG = "keep_output"
MAX_LINE = 100  # the same limit as [tool.ruff] line-length in pyproject.toml


class FenceError(ValueError):
    pass


def strip_solutions(source: str, where: str) -> str:
    """Replace every fenced solution region of one cell's source; unbalanced fences are errors."""
    out: list[str] = []
    inside = False
    for number, line in enumerate(source.splitlines(), 1):
        begin, end = BEGIN.match(line), END.match(line)
        if begin:
            if inside:
                raise FenceError(f"{where}, line {number}: BEGIN SOLUTION inside another solution")
            inside = True
            indent, hint = begin["indent"], begin["hint"].strip()
            out.append(f"{indent}# YOUR CODE HERE" + (f" {hint}" if hint else ""))
            out.append(
                f'{indent}raise NotImplementedError("exercise: replace this line with your code")'
            )
        elif end:
            if not inside:
                raise FenceError(f"{where}, line {number}: END SOLUTION without BEGIN")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise FenceError(f"{where}: BEGIN SOLUTION is never closed")
    return "\n".join(out)


def clear_outputs(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    for cell in nb.cells:
        if cell.cell_type == "code" and KEEP_OUTPUT_TAG not in cell.metadata.get("tags", []):
            cell.outputs = []
            cell.execution_count = None
        cell.metadata.pop("execution", None)
    return nb


def exercise_from_solution(path: Path) -> str:
    nb = clear_outputs(nbformat.read(path, as_version=4))
    fenced = 0
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and "### BEGIN SOLUTION" in cell.source:
            cell.source = strip_solutions(cell.source, f"{path.name} cell {i}")
            fenced += 1
    if fenced == 0:
        raise FenceError(
            f"{path.name}: no ### BEGIN SOLUTION region, so the exercise would be the solution"
        )
    banner = nbformat.v4.new_markdown_cell(
        f"*Exercise generated from `solutions/{path.name}` by `tools/make_exercises.py`: "
        "fill in each `# YOUR CODE HERE`, then run the check cell. "
        "Stuck? The solution notebook has the answer.*"
    )
    banner["id"] = "generated-banner"
    nb.cells.insert(0, banner)
    return nbformat.writes(nb) + "\n"


def notebooks_with_outputs() -> list[str]:
    found = []
    for folder in NOTEBOOK_DIRS:
        for path in sorted((ROOT / folder).glob("*.ipynb")):
            nb = nbformat.read(path, as_version=4)
            for i, cell in enumerate(nb.cells):
                kept = KEEP_OUTPUT_TAG in cell.metadata.get("tags", [])
                if cell.cell_type == "code" and not kept and (cell.outputs or cell.execution_count):
                    found.append(f"{folder}/{path.name} cell {i}")
                    break
    return found


def long_code_lines(paths: list[Path], limit: int = MAX_LINE) -> list[str]:
    """Every code cell line longer than ``limit`` characters, as ``file cell i, line n (len)``."""
    found = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            for number, line in enumerate(cell.source.splitlines(), 1):
                if len(line) > limit:
                    where = f"{path.parent.name}/{path.name} cell {i}, line {number}"
                    found.append(f"{where} has {len(line)} characters (at most {limit})")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="verify instead of writing")
    args = parser.parse_args(argv)
    problems: list[str] = []
    EXERCISES.mkdir(exist_ok=True)
    expected_names = set()
    for solution in sorted(SOLUTIONS.glob("*.ipynb")):
        target = EXERCISES / solution.name
        expected_names.add(target.name)
        try:
            text = exercise_from_solution(solution)
        except FenceError as exc:
            problems.append(str(exc))
            continue
        current = target.read_text() if target.exists() else None
        if current != text:
            if args.check:
                problems.append(
                    f"exercises/{target.name} is stale: run python tools/make_exercises.py"
                )
            else:
                target.write_text(text)
                print(f"wrote exercises/{target.name}")
    for orphan in sorted(p.name for p in EXERCISES.glob("*.ipynb")):
        if orphan not in expected_names:
            problems.append(f"exercises/{orphan} has no solutions/{orphan}")
    if args.check:
        problems += [
            f"{where} holds outputs: clear them before committing"
            for where in notebooks_with_outputs()
        ]
        notebooks = [p for d in NOTEBOOK_DIRS for p in sorted((ROOT / d).glob("*.ipynb"))]
        problems += long_code_lines(notebooks)
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
