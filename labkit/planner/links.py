"""Which link class each process group of a layout crosses, read off the real rank grid.

Every group's ranks come from :func:`labkit.parallel.layout.rank_grid` for the rank
``order`` (innermost axis first: Megatron's ``"tp-dp-pp"`` puts tp ranks adjacent, then dp,
pp outermost; Narayanan et al. 2021, section 3.3), and global rank ``r`` sits on node
``r // gpus_per_node``. So any divisor degree is placed as it really runs: at tp=4 on nodes
of 6 GPUs, the tp group ``[4, 5, 6, 7]`` straddles nodes 0 and 1; at tp=6 on nodes of 8,
``[6, ..., 11]`` does. No power-of-two or alignment assumption.

An axis's collectives run in lock-step over all its groups (every tp group all-reduces at
the same point of every layer), so the worst group paces the step:

* ``slow``: some group of the axis spans more than one node, so the slow (inter-node) link
  paces its ring; a pipeline talks stage to next stage, and a pipeline group that spans nodes
  has a boundary that crosses, which paces every micro-batch;
* ``nodes``: the most nodes one group spans; ``ranks_per_node``: the fewest of one group's
  ranks sharing a node (the two-level, hierarchical all-reduce sends ``1 / ranks_per_node`` of
  the bytes across nodes);
* ``balanced``: every group holds the same number of ranks on each node it touches, which the
  hierarchical all-reduce needs (``ranks_per_node x nodes`` = the group); a ragged group (tp=4
  on 3 nodes of 6 GPUs, dp groups like ``[0, 4, 8]`` with 2 ranks on node 0 and 1 on node 1)
  is priced as a flat ring on the slow link.

The embedding group (Megatron's: the first and last rank of each pipeline group, which sum
the tied embedding's gradient) is :func:`embedding_link`: two ranks, on two nodes exactly
when the pipeline group's ends sit on different nodes.

The other order, ``"dp-tp-pp"``, puts dp innermost and is the *wrong* placement the
mixed-interconnect scenario measures: tp all-reduces then cross the slow link.

Pure arithmetic: no processes (``rank_grid`` is a tensor reshape).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from labkit.parallel.layout import ParallelDegrees, rank_grid
from labkit.planner.cluster import Cluster

__all__ = ["ORDERS", "GroupLink", "embedding_link", "group_links", "placement"]

ORDERS = ("tp-dp-pp", "dp-tp-pp")  # innermost axis first


@dataclass(frozen=True)
class GroupLink:
    """One axis's placement: its link (alpha seconds, bandwidth bytes/s per GPU), whether
    that is the slow (inter-node) link, the fewest of a group's ranks sharing a node, the
    most nodes a group spans, and whether every group splits evenly over its nodes."""

    alpha: float
    bandwidth: float
    slow: bool
    ranks_per_node: int
    nodes: int
    balanced: bool = True

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1

    @property
    def ring_bandwidth(self) -> float:
        """Bytes/s one flat ring of this axis gets on its slowest hop.

        ``bandwidth`` is a node uplink's per-GPU share (uplink = ``bandwidth x gpus_per_node``).
        Any ring-shaped axis (tp's all-reduce, cp's K/V ring, dp's) gets it: a ring crossing
        a node edge shares that uplink only with the other rings crossing it, never with
        every GPU of the node. A ring over node-ordered ranks leaves a node once, so a node's
        uplink carries one flow per ring that touches the node: ``gpus_per_node /
        ranks_per_node`` rings, each with ``uplink / rings = bandwidth x ranks_per_node``
        (with the fewest ranks per node, an upper bound on the rings sharing it). Every hop of
        the ring carries ``2(p-1)/p D`` in all, so the crossing costs ``2(p-1)/p D /
        (bandwidth x ranks_per_node)``, not the per-GPU share for every rank. One NIC per
        node: plain link sharing; one NIC per GPU:
        NCCL's channels (several rings, each crossing on its own rail-aligned NIC) use as
        many NICs as a node has ranks of the ring. Inside a node: ``bandwidth``.
        """
        return self.bandwidth * self.ranks_per_node if self.slow else self.bandwidth


@lru_cache(maxsize=4096)
def placement(
    gpus_per_node: int, dp: int, tp: int, pp: int, order: str = "tp-dp-pp", cp: int = 1,
    ep: int = 1,
) -> dict[str, tuple[int, int, bool]]:  # fmt: skip
    """``{axis: (ranks_per_node, nodes, balanced)}`` of the rank grid's groups (module
    docstring), for nodes of ``gpus_per_node`` GPUs. With ``cp > 1`` also ``"cp"`` and
    ``"dp_cp"`` (the ranks a dense gradient is averaged over), with ``ep > 1`` ``"ep"`` (the
    all-to-all's group) and ``"edp"`` (the ranks averaging one expert's gradients): the
    groups :func:`labkit.parallel.layout.rank_grid` builds."""
    if order not in ORDERS:
        raise ValueError(f"rank order {order!r} is not one of {ORDERS}")
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node={gpus_per_node} must be >= 1")
    out = {}
    degrees = ParallelDegrees(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
    for axis, groups in rank_grid(degrees, order).items():
        fewest, most, balanced = len(groups[0]), 1, True
        for group in groups:
            counts: dict[int, int] = {}
            for r in group:
                counts[r // gpus_per_node] = counts.get(r // gpus_per_node, 0) + 1
            fewest = min(fewest, *counts.values())
            most = max(most, len(counts))
            balanced = balanced and len(set(counts.values())) == 1
        out[axis] = (fewest, most, balanced)
    return out


def group_links(
    cluster: Cluster, dp: int, tp: int, pp: int, order: str = "tp-dp-pp", cp: int = 1,
    ep: int = 1,
) -> dict[str, GroupLink]:  # fmt: skip
    """``{"tp": GroupLink, "dp": ..., "pp": ...}`` (and ``cp``, ``dp_cp``, ``ep``, ``edp``
    when those degrees exceed 1, :func:`placement`) for ranks ordered by ``order`` on
    ``cluster``'s nodes: the slow link for an axis whose groups span nodes."""
    fast = (cluster.intra_latency, cluster.intra_bandwidth)
    slow = (cluster.inter_latency, cluster.inter_bandwidth)
    out = {}
    for axis, (per_node, nodes, balanced) in placement(
        cluster.gpus_per_node, dp, tp, pp, order, cp, ep
    ).items():
        crosses = nodes > 1
        alpha, bw = slow if crosses else fast
        out[axis] = GroupLink(alpha, bw, crosses, per_node, nodes, balanced)
    return out


def embedding_link(
    cluster: Cluster, dp: int, tp: int, pp: int, order: str = "tp-dp-pp", cp: int = 1,
) -> GroupLink:  # fmt: skip
    """The link of Megatron's embedding groups: ``(first, last)`` rank of every pipeline group
    of the rank grid (its stages in pipeline order), where the tied embedding's gradient is
    all-reduced once a step. Slow when some group's two ranks sit on different nodes. Every
    such pair all-reduces at once and every GPU of the first and last stage is in one, so a
    crossing pair gets the uplink's per-GPU share (``ranks_per_node`` 1). ``pp = 1``: one
    rank holds both ends; the returned link is never used."""
    if order not in ORDERS:
        raise ValueError(f"rank order {order!r} is not one of {ORDERS}")
    if pp == 1:
        return GroupLink(cluster.intra_latency, cluster.intra_bandwidth, False, 1, 1)
    if _ends_cross(cluster.gpus_per_node, dp, tp, pp, order, cp):
        return GroupLink(cluster.inter_latency, cluster.inter_bandwidth, True, 1, 2)
    return GroupLink(cluster.intra_latency, cluster.intra_bandwidth, False, 2, 1)


@lru_cache(maxsize=4096)
def _ends_cross(gpus_per_node: int, dp: int, tp: int, pp: int, order: str, cp: int) -> bool:
    """Whether some pipeline group's first and last rank sit on different nodes."""
    groups = rank_grid(ParallelDegrees(dp=dp, tp=tp, pp=pp, cp=cp), order)["pp"]
    return any(g[0] // gpus_per_node != g[-1] // gpus_per_node for g in groups)
