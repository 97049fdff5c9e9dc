"""The parallel layout: degrees (dp, tp, pp), the process groups built from them, and group helpers.

Every technique receives its ``group`` explicitly from a :class:`Layout`; nothing reads the
environment or a global. See ``layout.py``; the order in which techniques compose is written
once, in ``compose.py``.
"""

from labkit.parallel.compose import compose
from labkit.parallel.layout import (
    Layout,
    ParallelDegrees,
    build_layout,
    global_rank,
    group_rank_and_size,
    rank_grid,
)

__all__ = [
    "compose",
    "Layout",
    "ParallelDegrees",
    "build_layout",
    "global_rank",
    "group_rank_and_size",
    "rank_grid",
]
