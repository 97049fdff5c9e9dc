"""The emulated cluster's communication: the three all-reduces it compares, and their busbw.

Split from ``cluster.py`` (the DDP step and strong scaling, which re-exports all of this):
:func:`make_comm` builds labkit's flat ring (``Comm(impl="ring")``), the hierarchical
all-reduce (``Comm(impl="hierarchical")``, nodes from ``ranks_per_node``) or torch's; busbw
follows nccl-tests (:func:`labkit.collectives.cost_model.busbw_factor`):
``busbw = bytes * 2(p-1)/p / seconds``, medians of rank 0's clock over interleaved steps, each
call closed by a barrier. Every measurement launches through :func:`_launch` (gloo, one
thread per rank, the cluster when there is one).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from labkit.collectives.comm import Comm
from labkit.collectives.cost_model import busbw_factor
from labkit.collectives.hierarchical import node_groups
from labkit.measure.timing import interleaved_times

__all__ = ["COMMS", "busbw_worker", "make_comm", "measure_busbw"]

COMMS = ("torch", "ring", "hierarchical")


def make_comm(impl: str, ranks_per_node: int, wire: str = "accum", group: Any = None) -> Comm:
    """``Comm`` over ``group`` (None: WORLD): PyTorch's, labkit's flat ring, or the two-level
    all-reduce (WORLD only: its node groups cover the whole job)."""
    if impl == "hierarchical":
        if group is not None:
            raise ValueError("impl='hierarchical' runs over the whole world, not a subgroup")
        return Comm(None, impl="hierarchical", nodes=node_groups(ranks_per_node), wire=wire)
    return Comm(group, impl=impl, wire=wire)


def _launch(fn: Any, *args: Any, world_size: int, cluster: Any, timeout: float) -> list[Any]:
    from labkit.launch import launch

    options: dict[str, Any] = {"threads_per_rank": 1}
    if cluster is not None:
        options["cluster"] = cluster
    return launch(
        fn, *args, world_size=world_size, backend="gloo", timeout=timeout, quiet=True, **options
    )


# ------------------------------------------------------------------------------ busbw
def busbw_worker(
    sizes: Sequence[int], ranks_per_node: int, steps: int, warmup: int
) -> dict[str, dict[int, float]]:
    """On every rank: ``{impl: {bytes: median seconds}}`` of a float32 all-reduce."""
    comms = {impl: make_comm(impl, ranks_per_node) for impl in COMMS}
    out: dict[str, dict[int, float]] = {impl: {} for impl in COMMS}
    for size in sizes:
        buf = torch.zeros(max(1, size // 4))  # zeros: repeated sums stay finite
        fns = {impl: (lambda c=c, b=buf: c.all_reduce(b)) for impl, c in comms.items()}
        times = interleaved_times(fns, steps, warmup, sync=dist.barrier)
        for impl, t in times.items():
            out[impl][size] = statistics.median(t)
    return out


def measure_busbw(
    cluster: Any,
    world_size: int,
    sizes: Sequence[int] = (2**14, 2**17, 2**20, 2**22),
    *,
    steps: int = 5,
    warmup: int = 1,
    timeout: float = 300,
) -> dict[str, Any]:
    """``{"seconds": {impl: {bytes: s}}, "busbw": {impl: {bytes: B/s}}, "mode": ...}``."""
    rpn = cluster.topology(world_size).ranks_per_node  # ValueError before any process starts
    res = _launch(
        busbw_worker, list(sizes), rpn, steps, warmup,
        world_size=world_size, cluster=cluster, timeout=timeout,
    )[0]  # fmt: skip
    return _busbw_result(res, world_size, cluster.resolved_mode(), rpn)


def _busbw_result(res: Any, world_size: int, mode: str, rpn: int) -> dict[str, Any]:
    """:func:`measure_busbw`'s answer from rank 0's :func:`busbw_worker` seconds."""
    factor = busbw_factor("all_reduce", world_size)
    busbw = {impl: {s: s * factor / t for s, t in row.items()} for impl, row in res.items()}
    return {"seconds": res, "busbw": busbw, "mode": mode, "rpn": rpn}
