"""The book's source tree, staged from the repository and the executed lessons.

Layout mirrors the repository, so the README's relative links work unchanged:
``index.md`` (the README), ``notebooks/NN_*.ipynb`` (executed, widgets frozen),
``exercises/NN_*.ipynb`` (the task and its check: never a solution), ``docs/*.md`` (the recorded
GPU results, the planner's accuracy, the composition matrix, the walkthrough grades) and their
pictures. A link to a file outside the book becomes plain text naming the file, so no link
on a page is broken.
"""

from __future__ import annotations

import copy
import re
import shutil
from pathlib import Path
from typing import Any

import nbformat

from tools.book import figures, static_widgets
from tools.book.execute import ROOT

LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
HEADING = re.compile(r"\.ipynb#heading=")
DOCS = ["gpu_h200.md", "gpu_h100.md", "planner.md", "composition.md", "walkthrough_grades.md"]
GPU_CELL = "torch.cuda.is_available()"
MATH = re.compile(r"(?<![\\$])\$(?![\s$])([^$\n]+?)(?<!\s)\$(?!\d)")  # $...$ as JupyterLab reads it


def lessons() -> list[Path]:
    """The lessons in curriculum order, from the one list (``labkit.lessons``)."""
    from labkit.lessons import LESSONS

    return [ROOT / "notebooks" / f"{lesson.name}.ipynb" for lesson in LESSONS]


def exercises() -> list[Path]:
    return sorted((ROOT / "exercises").glob("[0-9][0-9]_*.ipynb"))


def _in_book(target: Path, staged: set[str]) -> bool:
    try:
        rel = target.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return False
    return rel in staged or rel == "README.md"


def relink(text: str, where: Path, staged: set[str]) -> str:
    """Keep links to pages and pictures of the book (JupyterLab's ``#heading=`` anchors become
    plain fragments); a link to any other repository file becomes its text and the path."""
    text = HEADING.sub(".ipynb#", text)

    def one(m: re.Match[str]) -> str:
        bang, label, target = m.groups()
        if re.match(r"^[a-z]+:|^#", target):
            return m.group(0)
        path = target.split("#", 1)[0]
        if _in_book(where.parent / path, staged):
            return m.group(0) if path != "README.md" else f"{bang}[{label}](index.md)"
        shown = path.removeprefix("../")
        return label if label.strip("`") == shown else f"{label} (`{shown}`)"

    return LINK.sub(one, text)


def mathml(text: str) -> str:
    """Inline ``$...$`` TeX as MathML, which browsers draw natively: no MathJax from a CDN, so
    the book stays whole offline."""
    from latex2mathml.converter import convert

    parts = re.split(r"(```.*?```|`[^`\n]*`)", text, flags=re.S)  # never inside code
    return "".join(p if i % 2 else MATH.sub(lambda m: convert(m.group(1)), p)
                   for i, p in enumerate(parts))  # fmt: skip


def gpu_records() -> list[tuple[str, str]]:
    """(page, title) of each recorded GPU run, e.g. ('gpu_h200.md', 'One H200, measured
    (2026-11-26 and 2026-11-27)'): the card and the dates come from the record itself."""
    out = []
    for name in DOCS:
        if name.startswith("gpu_") and (ROOT / "docs" / name).is_file():
            first = (ROOT / "docs" / name).read_text().splitlines()[0]
            out.append((name, first.lstrip("# ").strip()))
    return out


def _gpu_note() -> Any:
    links = "; ".join(f"[{title}](../docs/{page})" for page, title in gpu_records())
    text = ("```{note}\nThis cell needs a CUDA GPU; the machine that built this page had none, "
            f"so it shows the CPU path. What it measured on a GPU is recorded in: {links}.\n```")
    return nbformat.v4.new_markdown_cell(text)


def lesson_page(nb: Any, src: Path, staged: set[str]) -> Any:
    """An executed lesson ready for the book: widgets frozen, links kept inside the book, a
    pointer to the recorded GPU results after each cell that needs a GPU."""
    live = f"./lab {src.relative_to(ROOT).as_posix()}"
    nb = copy.deepcopy(nb)
    static_widgets.freeze(nb, live)
    cells = []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = mathml(relink(cell.source, src, staged))
        cells.append(cell)
        if cell.cell_type == "code" and GPU_CELL in cell.source:
            cells.append(_gpu_note())
    nb.cells = cells
    nb.metadata.pop("widgets", None)  # drawn statically: no widget JavaScript on the page
    return nb


def exercise_page(path: Path, staged: set[str]) -> Any:
    """The exercise as handed out (stubs and check, no outputs): its title first, then how to
    open it live."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = mathml(relink(cell.source, path, staged))
        else:
            cell.outputs, cell.execution_count = [], None
    title = next((i for i, c in enumerate(nb.cells)
                  if c.cell_type == "markdown" and c.source.startswith("# ")), None)  # fmt: skip
    if title:  # make_exercises puts its "generated from" note above the title
        nb.cells.insert(0, nb.cells.pop(title))
    rel = path.relative_to(ROOT).as_posix()
    note = nbformat.v4.new_markdown_cell(f"*Open it live with `./lab {rel}`.*")
    nb.cells.insert(1 if title is not None else 0, note)
    return nb


def stage(out: Path, executed: dict[Path, Any]) -> dict[str, int]:
    """Write the book's sources into ``out`` (emptied first); return figures per lesson page."""
    if out.exists():
        shutil.rmtree(out)
    (out / "notebooks").mkdir(parents=True)
    (out / "exercises").mkdir()
    (out / "docs").mkdir()
    staged = {p.relative_to(ROOT).as_posix() for p in [*lessons(), *exercises()]}
    pictures = sorted((ROOT / "docs").glob("*.png"))
    staged |= {f"docs/{n}" for n in DOCS} | {f"docs/{p.name}" for p in pictures}
    drawn = figures.readme_figures(executed)
    counts = {}
    for src in lessons():
        nb = executed[src]
        counts[src.stem] = static_widgets.figures_in(nb)
        nbformat.write(lesson_page(nb, src, staged), out / "notebooks" / src.name)
    for src in exercises():
        nbformat.write(exercise_page(src, staged), out / "exercises" / src.name)
    for name in DOCS:
        page = ROOT / "docs" / name
        (out / "docs" / name).write_text(relink(page.read_text(), page, staged))
    for png in pictures:
        shutil.copy2(png, out / "docs" / png.name)
    for name, data in drawn.items():  # the README's pictures, from this very execution
        (out / "docs" / f"{name}.png").write_bytes(data)
    readme = relink((ROOT / "README.md").read_text(), ROOT / "README.md", staged)
    (out / "index.md").write_text(readme + _toctrees())
    for name in ("conf.py", "favicon.svg"):
        shutil.copy2(Path(__file__).with_name(name), out / name)
    return counts


def _toctrees() -> str:
    def tree(caption: str, entries: list[str]) -> str:
        body = "\n".join(entries)
        return f"\n```{{toctree}}\n:caption: {caption}\n:maxdepth: 1\n:hidden:\n\n{body}\n```\n"

    return (tree("Lessons", [f"notebooks/{p.stem}" for p in lessons()])
            + tree("Exercises", [f"exercises/{p.stem}" for p in exercises()])
            + tree("Records", [f"docs/{Path(n).stem}" for n in DOCS]))  # fmt: skip
