"""One list of lessons: notebook 00's map and the README's curriculum table are both printed
from ``labkit.lessons.LESSONS``, and the list names every notebook, exercise and code path
that exists (00 once listed lessons 01-05 only while the README listed all of them)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from labkit.lessons import LESSONS, lesson, markdown_table

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_prints_the_list():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert markdown_table() in readme, "README's curriculum differs from labkit.lessons"
    # negative control: a README that lost a row (or typed one differently) is caught
    rows = markdown_table().splitlines()
    assert markdown_table() not in readme.replace(rows[-1] + "\n", "")
    assert markdown_table() not in readme.replace(LESSONS[3].learn, LESSONS[3].learn + " and more")


def test_the_list_names_every_notebook_and_only_what_exists():
    on_disk = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert [x.name for x in LESSONS] == on_disk
    assert [x.number for x in LESSONS] == list(range(len(LESSONS)))
    for x in LESSONS:
        for path in x.code:
            assert (ROOT / "labkit" / path).exists(), (x.name, path)
        if x.exercise:
            for folder in ("exercises", "solutions"):
                assert (ROOT / folder / f"{x.exercise}.ipynb").is_file(), (x.name, folder)
    assert lesson(15).name == "15_long_context"
    with pytest.raises(KeyError, match="no lesson 99"):
        lesson(99)


def test_the_welcome_notebook_prints_the_list_instead_of_typing_it():
    nb = nbformat.read(ROOT / "notebooks" / "00_welcome.ipynb", as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "markdown_table(" in code
    typed = [x.name for x in LESSONS if f"`{x.name}`" in text]
    assert not typed, f"00 types lessons by hand: {typed}"
