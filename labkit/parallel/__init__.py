"""The parallel layout: degrees (dp, tp, pp), the process groups built from them, and group helpers.

Every technique receives its ``group`` explicitly from a :class:`Layout`; nothing reads the
environment or a global. See ``layout.py``; the order in which techniques compose is written
once, in ``compose.py``: ``from labkit.parallel.compose import compose``.

Importing this package loads ``layout.py`` only. Techniques below it (collectives, DDP,
tensor parallelism, the pipeline) import ``labkit.parallel.layout``, which runs this file
first, while ``compose.py`` and ``threed.py`` import those techniques: re-exporting them here
would close an import circle (``parallel -> compose -> tensor_parallel -> parallel``), so
the composition modules are imported by their own path.
"""

from labkit.parallel.layout import (
    Layout,
    ParallelDegrees,
    build_layout,
    global_rank,
    group_rank_and_size,
    rank_grid,
)

__all__ = [
    "Layout",
    "ParallelDegrees",
    "build_layout",
    "global_rank",
    "group_rank_and_size",
    "rank_grid",
]
