"""Modules a reader takes in at once: the readable ring in one sitting, every module in one read.

``collectives/ring.py`` is the file a learner opens to see the algorithm, so it holds the
algorithm alone (validation, pools and wire modes live in ``common.py`` and ``ring_tuned.py``);
every other module stays at 300 lines or fewer, split where it has two jobs.
"""

from __future__ import annotations

from pathlib import Path

import labkit

ROOT = Path(labkit.__file__).parent
RING_LIMIT = 100  # lines, docstring included
MODULE_LIMIT = 300


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_the_readable_ring_fits_one_sitting() -> None:
    n = _lines(ROOT / "collectives" / "ring.py")
    assert n < RING_LIMIT, f"collectives/ring.py has {n} lines; the readable ring stays under 100"


def test_every_module_fits_one_read() -> None:
    sizes = {p.relative_to(ROOT).as_posix(): _lines(p) for p in ROOT.rglob("*.py")}
    assert len(sizes) > 100 and _lines(ROOT / "collectives" / "ring_tuned.py") > 50  # real tree
    long = {name: n for name, n in sorted(sizes.items()) if n > MODULE_LIMIT}
    assert not long, f"modules past {MODULE_LIMIT} lines (split them): {long}"
