"""A check run on an unfilled exercise stub names the placeholder in one short message, in a
real kernel, instead of a traceback through the check's internals; other errors keep theirs."""

from __future__ import annotations

import re

import nbformat
import pytest
from nbclient import NotebookClient

from labkit.checks.core import exercise_not_done, launch_check, not_done

STUB = 'raise NotImplementedError("exercise: replace this line with your code")'
CELLS = [
    "import labkit.checks.core as core\n"
    "def ring_all_gather(x):\n"
    "    # YOUR CODE HERE\n"
    f"    {STUB}\n",
    # a check that runs the stub in-process, a few frames down
    "def _inner(fn):\n    return fn(1)\ndef check(fn):\n    return _inner(fn)\n"
    "check(ring_all_gather)",
    # the learner's own NotImplementedError is a real error: its traceback stays
    "def mine():\n    raise NotImplementedError('my own message')\nmine()",
]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _stub_on_rank() -> None:
    exec(compile(f"def reduce_scatter():\n    {STUB}\n", "<cell>", "exec"), globals())
    globals()["reduce_scatter"]()


def test_stub_in_a_kernel_reads_as_one_line_naming_it():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in CELLS]
    NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True).execute()
    stub = [o for o in nb.cells[1].outputs if o.output_type == "error"]
    assert len(stub) == 1 and stub[0].ename == "NotImplementedError"
    shown = [ANSI.sub("", line) for line in stub[0].traceback]
    assert len(shown) == 1, shown  # before: ~20 lines through check() and _inner()
    assert "`ring_all_gather` (line 4 of its cell)" in shown[0]
    assert "# YOUR CODE HERE" in shown[0] and "_inner" not in shown[0]
    own = [o for o in nb.cells[2].outputs if o.output_type == "error"]
    assert own[0].evalue == "my own message" and len(own[0].traceback) > 2  # negative control


def test_launch_check_names_the_rank_and_the_stub():
    with pytest.raises(NotImplementedError) as info:
        launch_check(_stub_on_rank, world_size=1, timeout=60)
    where = getattr(info.value, "placeholder", None)
    assert where == "`reduce_scatter` (line 2 of its cell) on rank 0"
    assert info.value._render_traceback_()[0].count("\n") == 0  # type: ignore[attr-defined]
    assert not_done(info.value) is info.value
    assert not_done(ValueError("exercise: x")) is None  # only a stub's NotImplementedError
    assert not_done(NotImplementedError("something else")) is None
    assert "`f` (line 3" in str(exercise_not_done("`f` (line 3 of its cell)"))
