"""Build the book: ``.venv/bin/python -m tools.book build [--out DIR] [--offline-check]``.

Lessons come from the executed-copy cache (``tools/book/execute.py``; ``./run-tests`` fills it);
a lesson whose copy is missing or stale is executed first. Prints the time of each part, the
pages and the figures, and where to open the book.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from tools.book import execute, stage

ROOT = execute.ROOT
OUT = ROOT / "build" / "book"  # /build/ is git-ignored
SRC = ROOT / ".labkit" / "book-src"


def build(out: Path = OUT, quiet: bool = False) -> dict[str, int]:
    """Execute what the cache lacks, stage, run Sphinx; return figures per lesson page."""
    say = (lambda *a: None) if quiet else print
    t0 = time.perf_counter()
    executed, ran = {}, []
    for path in stage.lessons():
        nb = execute.cached(path)
        if nb is None:
            say(f"executing {path.relative_to(ROOT)} (no fresh copy in the cache)")
            nb = execute.execute_to_cache(path)
            ran.append(path.name)
        executed[path] = nb
    t1 = time.perf_counter()
    figures = stage.stage(SRC, executed)
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-j", "2", "-W",
           "--keep-going", str(SRC), str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)  # tools.book importable
    t2 = time.perf_counter()
    if done.returncode != 0:
        raise SystemExit(f"sphinx-build failed ({done.returncode}):\n{done.stderr[-6000:]}")
    pages = len(list(out.rglob("*.html")))
    say(f"lessons executed now: {len(ran)} of {len(executed)} ({t1 - t0:.0f} s); "
        f"staged and built in {t2 - t1:.0f} s: {pages} HTML files, "
        f"{sum(figures.values())} figures in {len(figures)} lessons")
    say(f"open {out / 'index.html'} in a browser, or serve it: "
        f"{sys.executable} -m http.server -d {out}")
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.book", description=__doc__)
    parser.add_argument("command", choices=["build"])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    build(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
