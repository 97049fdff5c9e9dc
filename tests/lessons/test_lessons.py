"""Every lesson runs top to bottom in a fresh kernel, once per ``./run-tests``.

Each lesson is executed here (nbclient, a kernel forked from the suite's kernel zygote) and its
executed copy written to the cache the book is built from (``tools/book/execute.py``), so the
book and the tests show the same execution and no lesson runs twice. A failing cell fails the
test with the notebook, the cell's number, its source and the error.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from tests.kernels import ipc_kernel_manager
from tools.book import execute, stage


@pytest.mark.parametrize("path", stage.lessons(), ids=lambda p: p.stem)
def test_lesson_runs_top_to_bottom(path: Path) -> None:
    out = execute.cache_path(path)
    out.unlink(missing_ok=True)  # the test always executes; the book reuses this execution
    nb = execute.execute_to_cache(path, km=ipc_kernel_manager("python3"))
    assert nb.metadata["labkit_book"]["key"] == execute.notebook_key(path)
    ran = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    assert all(c.execution_count for c in ran), "a code cell was not executed"


def test_a_failing_cell_is_named_with_its_error(tmp_path: Path) -> None:
    """Negative control: a lesson whose cell raises fails, naming the cell and the error."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# a lesson"),
                nbformat.v4.new_code_cell("x = 1"),
                nbformat.v4.new_code_cell("raise ValueError('the learner sees this')")]  # fmt: skip
    path = tmp_path / "99_broken.ipynb"
    nbformat.write(nb, path)
    with pytest.raises(execute.LessonFailed) as info:
        execute.execute(path, km=ipc_kernel_manager("python3"))
    text = str(info.value)
    assert "cell 2" in text and "the learner sees this" in text and "ValueError" in text
