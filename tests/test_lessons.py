"""One list of lessons: notebook 00's map and the README's curriculum table are both printed
from ``labkit.lessons.LESSONS``, and the list names every notebook, exercise and code path
that exists (00 once listed lessons 01-05 only while the README listed all of them)."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from labkit.interview.topics import topic_ids
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


def _index_lessons(text: str) -> dict[str, set[int]]:
    """Notebook 14's last column, per id: the lesson numbers it cites (links' targets and
    the walkthroughs, 13, left out)."""
    out: dict[str, set[int]] = {}
    for line in text.splitlines():
        m = re.match(r"^\|\s*([SAKP]\d+)\s*\|[^|]*\|[^|]*\|(.*)\|$", line)
        if m:
            cell = re.sub(r"\(\d\d_[^)]*\)", "", m[2])  # link targets repeat the number
            found = {int(x) for x in re.findall(r"(?<![\d§.])\b(\d{2})\b(?![\d.])", cell)}
            out[m[1]] = found - {13}
    return out


def test_the_interview_index_cites_every_lesson_that_rehearses_an_id():
    # 14 listed S3 under 04 and 05 but not the capstone 11, and K11 under 04 but not 17
    nb = nbformat.read(ROOT / "notebooks" / "14_interview_index.ipynb", as_version=4)
    text = nb.cells[0].source
    want: dict[str, set[int]] = {}
    for x in LESSONS:
        for tid in x.rehearses:
            want.setdefault(tid, set()).add(x.number)
    assert set(want) <= set(topic_ids())
    got = _index_lessons(text)
    assert {k: v for k, v in got.items() if v} == want
    # negative control: the index as it was (S3 without 11) is caught
    old = text.replace("; [notebook 11](11_gpt2_1p3b_capstone.ipynb)", "")
    assert _index_lessons(old)["S3"] != want["S3"]
