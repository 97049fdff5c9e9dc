"""The book in a real browser: built from the lessons' executed copies (``tests/lessons/
test_lessons.py`` runs first in ``./run-tests``; anything missing is executed by the build),
served on loopback, opened page by page in headless Chromium.

Checks, each with its negative control: every page loads with no console error, failed request
or page error (a page that throws is seen to); every figure an executed lesson holds is on its
page (counted per page); no internal link is broken, fragments included (a planted broken link
is found); a search for a lesson's term finds that lesson; the interview index's link lands on
its heading in walkthrough 13; an exercise page never holds its solution's code (the solution
notebook rendered as a page is caught).
"""

from __future__ import annotations

import html
import re
import threading
from functools import partial
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nbformat
import pytest

from tests.test_browser import CHROMIUM_FLAGS, _chromium, _requirements
from tools.book import __main__ as book
from tools.book.stage import exercises, lessons

ROOT = Path(__file__).resolve().parents[2]
BOOK = ROOT / ".labkit" / "book-test" / "html"
SHOTS = BOOK.parent
SEARCH = ("Ulysses", "15_long_context")  # a term and the lesson that teaches it
INDEX_LINK = ("14_interview_index", "13_interview_walkthroughs")


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        for key in ("id", "name"):
            if a.get(key):
                self.ids.add(str(a[key]))
        target = a.get("href") if tag in ("a", "link") else a.get("src")
        if target and tag in ("a", "link", "img", "script"):
            self.links.append(target)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(errors="replace"))
    return page


def broken_links(root: Path) -> list[str]:
    """Every internal link (page, picture, script, fragment) under ``root`` that leads nowhere."""
    pages = {p: _parse(p) for p in root.rglob("*.html")
             if not p.relative_to(root).as_posix().startswith("_")}  # not the theme's templates
    problems = []
    for path, page in pages.items():
        for link in page.links:
            parts = urlsplit(link)
            if parts.scheme or link.startswith("//"):
                continue
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                problems.append(f"{path.relative_to(root)} -> {link} (no such file)")
            elif parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _parse(target).ids
                if unquote(parts.fragment) not in ids:
                    problems.append(f"{path.relative_to(root)} -> {link} (no such heading)")
    return problems


def solution_lines(solution: Path) -> list[str]:
    """The code lines a solution adds between its BEGIN/END SOLUTION fences (long enough to be
    telling, and not also in the exercise handed out)."""
    nb = nbformat.read(solution, as_version=4)
    handed = (ROOT / "exercises" / solution.name).read_text()
    out, inside = [], False
    for cell in nb.cells:
        for line in cell.source.splitlines() if cell.cell_type == "code" else []:
            if "### BEGIN SOLUTION" in line:
                inside = True
            elif "### END SOLUTION" in line:
                inside = False
            elif inside and _telling(line.strip()) and line.strip() not in handed:
                out.append(line.strip())
    return out


def _telling(line: str) -> bool:
    return len(line) >= 12 and not line.startswith("#")


def leaks(page_html: str, lines: list[str]) -> list[str]:
    text = html.unescape(re.sub(r"<[^>]+>", "", page_html))
    flat = re.sub(r"\s+", "", text)
    return [line for line in lines if re.sub(r"\s+", "", line) in flat]


@pytest.fixture(scope="module")
def built() -> dict[str, int]:
    return book.build(BOOK, quiet=True)


def test_no_internal_link_is_broken(built, tmp_path: Path) -> None:
    assert (BOOK / "index.html").is_file() and (BOOK / "notebooks").is_dir()
    assert broken_links(BOOK) == []
    planted = tmp_path / "p.html"  # negative control: a dangling page and a dangling heading
    (tmp_path / "q.html").write_text('<h1 id="there">q</h1>')
    planted.write_text('<a href="missing.html">x</a><a href="q.html#not-there">y</a>'
                       '<a href="q.html#there">z</a>')  # fmt: skip
    assert len(broken_links(tmp_path)) == 2


def test_exercise_pages_never_show_the_solution(built) -> None:
    checked = 0
    for exercise in exercises():
        solution = ROOT / "solutions" / exercise.name
        lines = solution_lines(solution)
        page = (BOOK / "exercises" / exercise.with_suffix(".html").name).read_text()
        assert "YOUR CODE HERE" in page, f"{exercise.name}: the task is not on its page"
        assert leaks(page, lines) == [], f"{exercise.name} shows its solution"
        checked += bool(lines)
    assert checked >= len(exercises()) - 1  # each solution fences real code
    # negative control: the solution rendered as a page is caught
    from nbconvert import HTMLExporter

    solution = ROOT / "solutions" / exercises()[1].name
    page, _ = HTMLExporter().from_filename(str(solution))
    assert leaks(page, solution_lines(solution))


def test_the_book_in_a_browser(built) -> None:
    why = _requirements()
    if why:
        import os

        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI requires the book's browser test, but {why}")
        pytest.skip(why)
    from playwright.sync_api import sync_playwright

    handler = partial(_QuietHandler, directory=str(BOOK))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    pages = sorted(p.relative_to(BOOK).as_posix() for p in BOOK.rglob("*.html")
                   if not p.relative_to(BOOK).as_posix().startswith("_"))  # fmt: skip
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=_chromium(), headless=True,
                                         args=CHROMIUM_FLAGS)  # fmt: skip
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("console", lambda m: m.type == "error"
                    and errors.append(f"{m.text} ({m.location.get('url')})"))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("requestfailed", lambda r: errors.append(f"failed request {r.url}"))
            page.on("response", lambda r: r.status >= 400 and errors.append(f"{r.status} {r.url}"))
            seen = {}
            for rel in pages:
                errors.clear()
                page.goto(f"{base}/{rel}", wait_until="load")
                page.wait_for_timeout(50)
                assert errors == [], f"{rel}: {errors}"
                seen[rel] = page.locator(".cell_output img").count()
            for stem, figures in built.items():
                assert seen[f"notebooks/{stem}.html"] == figures, (stem, seen, built)
            assert sum(built.values()) >= 10  # the lessons do draw
            _search_finds_the_lesson(page, base)
            _index_link_lands_on_its_heading(page, base)
            for name in ("index", "notebooks/15_long_context", "exercises/02_ring"):
                page.goto(f"{base}/{name}.html", wait_until="load")
                page.screenshot(path=str(SHOTS / f"{name.replace('/', '-')}.png"))
            errors.clear()  # negative control: a page that throws is seen to
            page.goto("data:text/html,<script>throw new Error('planted')</script>")
            page.wait_for_timeout(100)
            assert any("planted" in e for e in errors)
            browser.close()
    finally:
        server.shutdown()


def _search_finds_the_lesson(page, base: str) -> None:
    term, lesson = SEARCH
    page.goto(f"{base}/search.html?q={term}", wait_until="load")
    page.wait_for_function("() => document.querySelectorAll('ul.search li a').length > 0",
                           timeout=30_000)  # fmt: skip
    hrefs = page.eval_on_selector_all("ul.search li a", "els => els.map(e => e.href)")
    assert any(lesson in h for h in hrefs), hrefs


def _index_link_lands_on_its_heading(page, base: str) -> None:
    index, walkthrough = INDEX_LINK
    page.goto(f"{base}/notebooks/{index}.html", wait_until="load")
    link = page.locator(f"a[href*='{walkthrough}.html#']").first
    href = link.get_attribute("href")
    link.click()
    page.wait_for_url(f"**/{walkthrough}.html#*")
    fragment = unquote(page.evaluate("location.hash").lstrip("#"))
    top = page.evaluate("id => document.getElementById(id).getBoundingClientRect().top", fragment)
    height = page.evaluate("innerHeight")
    assert 0 <= top < height / 3, f"{href}: heading at {top}px of a {height}px window"


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def test_every_lesson_is_a_page(built) -> None:
    assert {p.stem for p in lessons()} == set(built)


def test_the_readme_pictures_are_the_lessons_own_figures(built, monkeypatch) -> None:
    from tools.book import execute, figures

    executed = {p: execute.cached(p) for p in lessons()}
    assert all(nb is not None for nb in executed.values())  # the book read these copies
    drawn = figures.readme_figures(executed)
    assert sorted(drawn) == sorted(figures.readme_pictures()) and len(drawn) >= 5
    front = (BOOK / "index.html").read_text()
    for name, png in drawn.items():  # the book's front page shows this very execution's
        assert (book.SRC / "docs" / f"{name}.png").read_bytes() == png
        assert re.search(rf'<img[^>]+src="[^"]*{name}[^"]*\.png"', front), name
    # negative control: a README picture no lesson cell draws is refused
    monkeypatch.setattr(figures, "readme_pictures", lambda: [*drawn, "not_drawn_anywhere"])
    with pytest.raises(ValueError, match="not_drawn_anywhere"):
        figures.readme_figures(executed)
