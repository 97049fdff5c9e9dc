#!/usr/bin/env python3
"""Write the README's pictures into docs/*.png from the lessons' own executions.

    .venv/bin/python tools/render_figures.py            # all pictures
    .venv/bin/python tools/render_figures.py ring zero_ledger

Each picture ``docs/NAME.png`` is the first figure of the one lesson cell tagged
``readme:NAME`` (``tools/book/figures.py``), taken from the executed copy that ``./run-tests``
or ``./lab book`` left in the cache; a lesson with no fresh copy is executed first. So the
README shows exactly what the lesson and the book show:

* ``ring``          the ring all-reduce's steps on 4 ranks (lesson 02)
* ``ddp_overlap``   bucketed vs overlapped DDP timelines on 2 ranks (lesson 03)
* ``zero_ledger``   ZeRO's measured memory ledger per stage on 2 ranks (lesson 05)
* ``memory_widget`` the memory widget for GPT-2 1.3B (lesson 11)
* ``scaling``       the measured 1..2-rank scaling curve with the modeled one (lesson 11)
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.book import execute, figures, stage  # noqa: E402


def main(names: list[str]) -> None:
    cells = figures.tagged_cells(stage.lessons())  # the one list of lessons
    bad = [n for n in names if n not in cells]
    if bad:
        raise SystemExit(f"unknown picture(s) {bad}; choose from {sorted(cells)}")
    for name in names or figures.readme_pictures():
        path, index = cells[name]
        nb = execute.execute_to_cache(path)
        png = figures.first_image(nb, index)
        if png is None:
            raise SystemExit(f"{path.name} cell {index} (readme:{name}) drew no picture")
        (ROOT / "docs" / f"{name}.png").write_bytes(png)
        print(f"wrote docs/{name}.png from {path.name} cell {index}")


if __name__ == "__main__":
    main(sys.argv[1:])
