"""What the lesson notebooks put on screen, checked from their source (fast; the real-browser
test runs the same drawing idioms in JupyterLab and counts the images).

- No notebook switches matplotlib to Agg: under Agg a figure assigned to a variable never
  shows, so figures the prose describes are missing.
- No cell ends with a bare call whose value is not meant to be shown: a returned Figure shows
  twice (its repr and the inline backend's flush), a returned tuple of timelines prints
  thousands of ``TimedAction(...)`` lines. Widgets (``...Widget(...)``, ``widget``) are the
  exception: showing them is the point.
- 14's links into 13 use JupyterLab's heading fragments (``#heading=<id>``), which it resolves
  from the notebook model; a bare ``#<id>`` is looked up in rendered DOM that may not be
  there. (On 13's first open JupyterLab 4.6 still lands at the top; the browser test reports
  it.)
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
LESSONS = sorted(NOTEBOOKS.glob("*.ipynb"))
SHOWN = re.compile(r"(Widget|widget)$")  # a widget as the last expression: meant to show


def _code_cells(path: Path):
    nb = nbformat.read(path, 4)
    return [(i, c.source) for i, c in enumerate(nb.cells) if c.cell_type == "code"]


def _bare_last_call(source: str) -> str | None:
    """The name of the call a cell ends with, if its value would be displayed."""
    if source.rstrip().endswith(";"):
        return None
    try:
        body = ast.parse(source).body
    except SyntaxError:  # a cell with IPython magics: not among the lessons here
        return None
    if not body or not isinstance(body[-1], ast.Expr) or not isinstance(body[-1].value, ast.Call):
        return None
    func = body[-1].value.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "?")
    # these return None (labkit's quiz prints its questions; World.close ends the ranks)
    if name in ("print", "display", "show", "quiz", "close") or SHOWN.search(name):
        return None
    return name


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name[:2])
def test_lessons_show_each_figure_once_and_no_reprs(path):
    problems = []
    for i, src in _code_cells(path):
        if re.search(r"""matplotlib\.use\(\s*["']Agg""", src):
            problems.append(f"cell {i} switches matplotlib to Agg: its figures never show")
        name = _bare_last_call(src)
        if name:
            problems.append(f"cell {i} ends with {name}(...): its return value is displayed")
    assert not problems, f"{path.name}: " + "; ".join(problems)


def test_the_source_check_catches_what_the_browser_showed():
    """Negative controls: the cells as the browser pass found them are flagged."""
    assert _bare_last_call("fig = f()\ncomm_vs_compute(tps, rows)") == "comm_vs_compute"
    assert _bare_last_call('show_run("interleaved", v=2)') == "show_run"
    assert _bare_last_call('plot_breakdown({"a": 1}, title=fault)') == "plot_breakdown"
    assert _bare_last_call("activation_bars(a, b);") is None
    assert _bare_last_call('MemoryWidget("gpt2-1.3b")') is None
    assert _bare_last_call("print(x)") is None


def _heading_ids(path: Path) -> set[str]:
    """JupyterLab's ids for markdown headings: the heading text, spaces turned into '-'."""
    ids = set()
    for c in nbformat.read(path, 4).cells:
        if c.cell_type == "markdown":
            for line in c.source.splitlines():
                m = re.match(r"#{1,6}\s+(.*\S)", line)
                if m:
                    ids.add(m.group(1).replace(" ", "-"))
    return ids


def test_index_links_open_the_walkthroughs_at_their_section():
    index = next(NOTEBOOKS.glob("14_*.ipynb"))
    target = next(NOTEBOOKS.glob("13_*.ipynb"))
    text = "".join(c.source for c in nbformat.read(index, 4).cells if c.cell_type == "markdown")
    fragments = re.findall(rf"{re.escape(target.name)}(#[^)\s]*)?\)", text)
    # one bare link opens 13 itself (JupyterLab jumps to a section of an open notebook only)
    assert fragments.count("") <= 1, "14 links to 13 without a section more than once"
    fragments = [f for f in fragments if f]
    assert len(fragments) >= 25, "14 should link each interview id to its section in 13"
    ids = _heading_ids(target)
    bad = [f or "(none)" for f in fragments if not f.startswith("#heading=")]
    assert not bad, f"links into 13 without a #heading= fragment: {bad[:5]}"
    missing = [f for f in fragments if f.removeprefix("#heading=") not in ids]
    assert not missing, f"fragments naming no heading of {target.name}: {missing[:5]}"
