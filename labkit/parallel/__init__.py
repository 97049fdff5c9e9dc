"""The parallel layout: degrees (dp, tp, pp), the process groups built from them, and group helpers.

Every technique receives its ``group`` explicitly from a :class:`Layout`; nothing reads the
environment or a global. See ``layout.py``.
"""

from labkit.parallel.layout import (
    Layout,
    ParallelDegrees,
    build_layout,
    global_rank,
    group_rank_and_size,
    rank_grid,
)

__all__ = ["Layout", "ParallelDegrees", "build_layout", "global_rank", "group_rank_and_size", "rank_grid"]
