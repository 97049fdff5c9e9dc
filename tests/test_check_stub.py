"""A check run on an unfilled exercise stub names the placeholder in one short message, in a
real kernel, instead of a traceback through the check's internals; other errors keep theirs.
A stub in what the check is handed is named before any process starts (from the code object:
no source needed); one the scan cannot see is named from the rank that raised it."""

from __future__ import annotations

import re

import nbformat
import pytest
from nbclient import NotebookClient
from torch import nn

import labkit.checks.core as core
from labkit.checks.core import exercise_not_done, launch_check, not_done
from labkit.checks.stub_scan import find_stub

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


def _stub_on_rank() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:  # one rank's stub: the check must name that rank
        exec(compile(f"def reduce_scatter():\n    {STUB}\n", "<cell>", "exec"), globals())
        globals()["reduce_scatter"]()
    return dist.get_rank()


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


@pytest.mark.usefixtures("checks_on_warm_ranks")  # the check's ranks: a warm world's
def test_launch_check_names_the_rank_and_the_stub():
    # The stub is compiled on the rank, so no scan before the launch can see it: this is the
    # path a stub in a global the learner's function calls takes.
    with pytest.raises(NotImplementedError) as info:
        launch_check(_stub_on_rank, world_size=2, timeout=60)
    where = getattr(info.value, "placeholder", None)
    assert where == "`reduce_scatter` (line 2 of its cell) on rank 1"
    assert info.value._render_traceback_()[0].count("\n") == 0  # type: ignore[attr-defined]
    assert not_done(info.value) is info.value
    assert not_done(ValueError("exercise: x")) is None  # only a stub's NotImplementedError
    assert not_done(NotImplementedError("something else")) is None
    assert "`f` (line 3" in str(exercise_not_done("`f` (line 3 of its cell)"))


LEARNER = f"""
class Col(nn.Module):
    def __init__(self, full):
        super().__init__()
        # YOUR CODE HERE
        {STUB}

    @property
    def shard(self):
        return 1


def outer():
    def inner():
        {STUB}
    return inner


def done(x):
    \"\"\"exercise: a docstring is not a stub\"\"\"
    if x is None:
        raise NotImplementedError("my own message")
    return x
"""


def test_a_stub_in_the_arguments_is_named_before_any_process_starts(monkeypatch):
    learner: dict = {"nn": nn}
    exec(compile(LEARNER, "<cell>", "exec"), learner)  # no source file: the code alone counts
    launched: list = []

    def launch(fn: object, *args: object, **options: object) -> list[str]:
        launched.append(fn)
        return ["ran"]

    monkeypatch.setattr(core, "launch", launch)
    for args, where in [
        ((learner["Col"],), "`Col.__init__` (line 6 of its cell)"),  # a class's method
        ((learner["done"], learner["outer"]), "`outer.<locals>.inner` (line 15 of its cell)"),
    ]:
        with pytest.raises(NotImplementedError) as info:
            launch_check(lambda *fns: None, *args, world_size=2)
        assert info.value.placeholder == where  # type: ignore[attr-defined]
        assert not_done(info.value) is info.value
    assert launched == []  # named here, before any process
    # negative control: finished code (with its own NotImplementedError) is launched
    assert launch_check(learner["done"], 1, world_size=2) == ["ran"] and launched
    assert find_stub(learner["done"], nn.Linear, len) is None
