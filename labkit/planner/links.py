"""Which link class each process group of a layout crosses, from the rank order alone.

A layout's groups are strided slices of the global ranks. With the axes ordered innermost
first (Megatron's ``"tp-dp-pp"``: tp ranks adjacent, then dp, pp outermost; Narayanan et al.
2021, section 3.3), the axis at position ``i`` has stride ``prod(degrees of the axes inside
it)``, and a group of ``n`` ranks at stride ``s`` in nodes of ``g`` GPUs holds

    ranks per node   min(n, g / s)  when s < g, else 1      (g, s powers of two, aligned)
    nodes            ceil(n / ranks per node)

A group on one node talks over the fast link (NVLink); one spanning nodes is paced by the
slow link. A pipeline talks stage to neighbour stage, but once one boundary crosses nodes
that boundary paces every micro-batch, so a pipeline spanning nodes is charged the slow
link too. The other order, ``"dp-tp-pp"``, puts dp innermost and is the *wrong*
placement the mixed-interconnect scenario measures: tp all-reduces then cross the slow link.

Pure arithmetic: no processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.planner.cluster import Cluster

__all__ = ["ORDERS", "GroupLink", "group_links"]

ORDERS = ("tp-dp-pp", "dp-tp-pp")  # innermost axis first


@dataclass(frozen=True)
class GroupLink:
    """One group's placement: its link (alpha seconds, bandwidth bytes/s per GPU), whether
    that is the slow (inter-node) link, how many of its ranks share a node and how many
    nodes it spans."""

    alpha: float
    bandwidth: float
    slow: bool
    ranks_per_node: int
    nodes: int

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1


def group_links(
    cluster: Cluster, dp: int, tp: int, pp: int, order: str = "tp-dp-pp"
) -> dict[str, GroupLink]:
    """``{"tp": GroupLink, "dp": ..., "pp": ...}`` for ranks ordered by ``order``."""
    if order not in ORDERS:
        raise ValueError(f"rank order {order!r} is not one of {ORDERS}")
    g = cluster.gpus_per_node
    sizes = {"dp": dp, "tp": tp, "pp": pp}
    fast = (cluster.intra_latency, cluster.intra_bandwidth)
    slow = (cluster.inter_latency, cluster.inter_bandwidth)
    out, stride = {}, 1
    for axis in order.split("-"):
        n = sizes[axis]
        per_node = min(n, g // stride) if stride < g else 1
        nodes = -(-n // per_node)
        crosses = nodes > 1  # for pp: some stage boundary crosses, and paces the pipeline
        alpha, bw = slow if crosses else fast
        out[axis] = GroupLink(alpha, bw, crosses, per_node, nodes)
        stride *= n
    return out
