"""Exercise mechanics: generated from solutions, never stale, stubs raise and nothing else fails."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.kernels import ipc_kernel_manager

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location(
    "make_exercises", ROOT / "tools" / "make_exercises.py"
)
assert spec and spec.loader
make_exercises = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_exercises)

EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))


def test_fenced_region_becomes_a_stub_at_its_indentation():
    source = (
        "def f(x):\n    ### BEGIN SOLUTION (hint: one line)\n"
        "    return x + 1\n    ### END SOLUTION\nprint(f)"
    )
    assert make_exercises.strip_solutions(source, "t") == (
        "def f(x):\n    # YOUR CODE HERE (hint: one line)\n"
        '    raise NotImplementedError("exercise: replace this line with your code")\nprint(f)'
    )


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("### BEGIN SOLUTION\nx = 1", "never closed"),
        ("x = 1\n### END SOLUTION", "END SOLUTION without BEGIN"),
        ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION", "inside another"),
    ],
)
def test_unbalanced_fences_are_errors(source, message):
    with pytest.raises(make_exercises.FenceError, match=message):
        make_exercises.strip_solutions(source, "t")


def test_every_exercise_is_generated_from_its_solution_and_notebooks_are_clean():
    # Fails when a solution changed without regenerating, or a notebook was committed with outputs.
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "make_exercises.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert {p.name for p in EXERCISES} == {p.name for p in (ROOT / "solutions").glob("*.ipynb")}


def test_stale_exercise_is_detected(tmp_path, monkeypatch):
    solutions, exercises = tmp_path / "solutions", tmp_path / "exercises"
    solutions.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION"
        )
    ]
    nbformat.write(nb, solutions / "01_x.ipynb")
    for name in ("ROOT", "SOLUTIONS", "EXERCISES"):
        monkeypatch.setattr(
            make_exercises,
            name,
            {"ROOT": tmp_path, "SOLUTIONS": solutions, "EXERCISES": exercises}[name],
        )
    assert make_exercises.main(["--check"]) == 1  # missing
    assert make_exercises.main([]) == 0
    assert make_exercises.main(["--check"]) == 0
    nb.cells[0].source = "import math\n" + nb.cells[0].source
    nbformat.write(nb, solutions / "01_x.ipynb")
    assert make_exercises.main(["--check"]) == 1  # the solution moved on


def test_long_code_cell_lines_are_reported(tmp_path):
    nb = nbformat.v4.new_notebook()
    long_line = "x = " + "1 + " * 30 + "1"  # 125 characters
    nb.cells = [
        nbformat.v4.new_markdown_cell("prose " * 40),  # prose may run long: only code counts
        nbformat.v4.new_code_cell("y = 2\n" + long_line),
        nbformat.v4.new_code_cell("z = " + "2" * (make_exercises.MAX_LINE - 4)),  # at the limit
    ]
    path = tmp_path / "01_x.ipynb"
    nbformat.write(nb, path)
    found = make_exercises.long_code_lines([path])
    assert found == [f"{tmp_path.name}/01_x.ipynb cell 1, line 2 has 125 characters (at most 100)"]


# Each exercise still runs in its own fresh kernel, as a learner runs it; two kernels run at a
# time (a kernel mostly waits on imports and, in 12, on its drill's ranks: a check names an
# unfilled stub before it starts any, labkit/checks/stub_scan.py). Results are per notebook: an
# error in one cannot hide another.
PARALLEL_KERNELS = 2
# Started first, so that the other kernel works through the short ones meanwhile and the two
# end together: 12's second check cell runs a whole mystery drill on ranks (about 20 s, most
# of the fixture's time since checks name an unfilled stub before starting any process).
LONGEST_FIRST = ("12_diagnosis.ipynb",)


async def _execute(path: Path, gate: asyncio.Semaphore) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    async with gate:
        await NotebookClient(
            nb,
            km=ipc_kernel_manager("python3"),  # no TCP ports to race tests/' jobs for
            timeout=120,
            kernel_name="python3",
            allow_errors=True,
            resources={"metadata": {"path": str(path.parent)}},
            shutdown_kernel="immediate",  # its outputs are all we need: no graceful wait
        ).async_execute(cleanup_kc=True)  # a kernel we passed in is ours to shut down
    return nb


async def _execute_all(paths: list[Path]) -> list[nbformat.NotebookNode | BaseException]:
    """Every notebook's result, in the order of ``paths`` (started longest first)."""
    gate = asyncio.Semaphore(PARALLEL_KERNELS)
    order = sorted(range(len(paths)), key=lambda i: paths[i].name not in LONGEST_FIRST)
    runs = {i: asyncio.ensure_future(_execute(paths[i], gate)) for i in order}
    await asyncio.gather(*runs.values(), return_exceptions=True)
    return [runs[i].exception() or runs[i].result() for i in range(len(paths))]


@pytest.fixture(scope="module")
def executed() -> dict[str, nbformat.NotebookNode | BaseException]:
    assert set(LONGEST_FIRST) <= {p.name for p in EXERCISES}, "a renamed exercise: update it"
    return dict(zip((p.name for p in EXERCISES), asyncio.run(_execute_all(EXERCISES))))


@pytest.mark.timeout(600)  # the first test also waits for every notebook (two at a time)
@pytest.mark.parametrize("path", EXERCISES, ids=[p.stem for p in EXERCISES])
def test_exercise_runs_with_no_error_but_its_stubs(path, executed):
    # nbval's raises-exception tag also passes when nothing raises, so it cannot prove this.
    nb = executed[path.name]
    if isinstance(nb, BaseException):
        raise nb
    errors = [
        (i, out)
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.output_type == "error"
    ]
    assert errors, f"{path.name}: no cell raised, so the stubs do not stop the learner"
    for i, out in errors:
        assert out.ename == "NotImplementedError", (
            f"{path.name} cell {i} raised {out.ename}: {out.evalue}"
        )
