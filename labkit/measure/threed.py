"""What the 3D miniature needs to be predicted: this machine's matmul FLOP/s and the gloo
all-reduce's alpha and bandwidth, measured, then put into a :class:`~labkit.planner.Cluster`.

The planner sees a CPU process like a GPU: ``peak_flops`` is the FLOP/s one rank gets when
all ranks share the cores (single-thread matmul rate x cores / ranks); both link classes are
gloo over loopback, so intra- and inter-"node" links are the same measured pair.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from labkit.planner.cluster import Cluster

__all__ = ["all_reduce_seconds", "cpu_cluster", "gloo_alpha_bandwidth", "matmul_flops", "miniature"]


def matmul_flops(n: int = 256, repeats: int = 20) -> float:
    """FLOP/s of one thread multiplying (n, n) fp32 matrices: median of ``repeats``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm-up
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            samples.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return 2 * n**3 / statistics.median(samples)


def all_reduce_seconds(
    numels: tuple[int, ...], repeats: int, group: dist.ProcessGroup | None = None
) -> list[float]:
    """On every rank of the world: the median seconds of an fp32 all-reduce of each of
    ``numels`` elements over ``group`` (one warm-up each, a world barrier before each timed
    call); every rank returns the same numbers, the slowest rank's medians."""
    medians = []
    for numel in numels:
        x = torch.ones(numel)
        dist.all_reduce(x, group=group)  # warm-up
        samples = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x, group=group)
            samples.append(time.perf_counter() - start)
        medians.append(statistics.median(samples))
    t = torch.tensor(medians, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # every rank agrees on the same numbers
    return t.tolist()


def gloo_alpha_bandwidth(
    small: int = 1, large: int = 1 << 18, repeats: int = 5
) -> tuple[float, float]:
    """On every rank of the world: (alpha seconds, bandwidth bytes/s) solved from the median
    times of a ``small``- and a ``large``-element fp32 all-reduce and the ring formula
    ``t = 2(n-1) alpha + 2(n-1)/n D / bw``."""
    n = dist.get_world_size()
    t_small, t_large = all_reduce_seconds((small, large), repeats)
    alpha = t_small / (2 * (n - 1))
    ring_bytes = 2 * (n - 1) / n * 4 * (large - small)
    bandwidth = ring_bytes / max(t_large - t_small, 1e-9)
    return alpha, bandwidth


def cpu_cluster(flops_one_thread: float, alpha: float, bandwidth: float, ranks: int,
                gpus_per_node: int, cores: int | None = None) -> Cluster:  # fmt: skip
    """This machine as the planner's cluster of ``ranks`` processes in nodes of
    ``gpus_per_node``: each rank's share of the cores, one link class measured by gloo."""
    cores = cores or os.cpu_count() or 1
    per_rank = flops_one_thread * min(1.0, cores / ranks)
    return Cluster(
        nodes=ranks // gpus_per_node, gpus_per_node=gpus_per_node,
        memory_bytes=16e9,  # not hardware: the miniature's nominal memory
        peak_flops=per_rank, intra_bandwidth=bandwidth, inter_bandwidth=bandwidth,
        intra_latency=alpha, inter_latency=alpha, name="this CPU (gloo)",
    )  # fmt: skip


def miniature(cfg: Any) -> dict[str, Any]:
    """On every rank: measure gloo's alpha and bandwidth, then train the 3D lab's ``cfg``
    (:func:`labkit.labs.threed.train`); returns its result with ``link`` added."""
    from labkit.labs.threed import train

    link = gloo_alpha_bandwidth()
    out = train(cfg)
    out["link"] = link
    return out
