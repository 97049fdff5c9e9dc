"""What the miniature of notebook 10 measures: the fitted alpha-beta of each link class of an
emulated cluster under the load its layouts put on them, the planner's cluster built from
it, and a layout's measured step out of the per-rank results of
:func:`labkit.labs.mixed_links.train_layouts`."""

from __future__ import annotations

import statistics
from typing import Any

import torch.distributed as dist

from labkit.collectives.cost_model import AlphaBeta, fit_alpha_beta
from labkit.collectives.hierarchical import node_groups
from labkit.measure.threed import all_reduce_seconds
from labkit.planner.cluster import Cluster

__all__ = ["measure_links", "measured_step", "miniature_cluster"]


def measure_links(
    ranks_per_node: int, sizes: tuple[int, ...], repeats: int
) -> dict[str, AlphaBeta]:
    """On every rank: the fitted alpha-beta of an all-reduce inside each node (all nodes at
    once) and across nodes (one rank per node, every local rank at once, sharing the uplink
    as the workload does); every rank returns the same numbers (the slowest rank's times)."""
    groups = node_groups(ranks_per_node)
    out = {}
    for name, group in (("intra", groups.intra), ("inter", groups.inter)):
        p = dist.get_world_size(group)
        seconds = all_reduce_seconds(tuple(sizes), repeats, group)
        out[name] = fit_alpha_beta([4.0 * s for s in sizes], seconds,
                                   steps=2 * (p - 1), bytes_factor=2 * (p - 1) / p)  # fmt: skip
    return out


def miniature_cluster(
    links: dict[str, AlphaBeta], flops_one_thread: float, world_size: int,
    ranks_per_node: int, cores: int,
) -> Cluster:  # fmt: skip
    """The CPU ranks as the planner's cluster: each rank's share of the cores' matmul FLOP/s,
    the measured intra and inter links. The planner counts 16-bit messages and gradients; the
    miniature sends fp32 (twice the bytes), so each link's bandwidth is stated in 16-bit bytes
    (halved): the predicted seconds are then those of the fp32 transfers."""
    per_rank = flops_one_thread * min(1.0, cores / world_size)
    return Cluster(
        nodes=world_size // ranks_per_node, gpus_per_node=ranks_per_node,
        memory_bytes=16e9,  # not hardware: the miniature's nominal memory
        peak_flops=per_rank,
        intra_bandwidth=links["intra"].bandwidth / 2, inter_bandwidth=links["inter"].bandwidth / 2,
        intra_latency=links["intra"].alpha, inter_latency=links["inter"].alpha,
        name="this CPU, emulated nodes",
    )  # fmt: skip


def measured_step(results: list[dict[str, Any]], name: str) -> dict[str, float]:
    """One layout's measured seconds: the median over ranks of each rank's median step, and of
    each part (``compute`` includes the tp all-reduces; ``optimizer`` the dp reduction)."""
    runs = [r["runs"][name] for r in results]
    out = {"step": statistics.median(statistics.median(r["times"]) for r in runs)}
    for key in runs[0]["parts"][0]:
        out[key] = statistics.median(statistics.median(p[key] for p in r["parts"]) for r in runs)
    return out
