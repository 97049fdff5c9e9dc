"""Pieces of the walkthroughs' "Say" lines computed rather than typed (issue 35).

* :func:`placement_words`: where each parallel axis of a layout sits, read off the real rank
  grid (:func:`labkit.planner.links.group_links`, tp innermost, then dp, pp outermost):
  "tp=4 inside a node, dp=2 inside a node, pp=8 across 8 nodes". A Say line that places an
  axis prints this, so it cannot say "dp crosses nodes" when the grid keeps dp on NVLink.
* :func:`fp16_flush_below`: the magnitude under which an fp16 cast returns exactly zero,
  found by casting (round to nearest even: half the smallest subnormal, 2^-25, ties to 0).
"""

from __future__ import annotations

import torch

from labkit.planner.cluster import Cluster
from labkit.planner.links import group_links
from labkit.planner.space import Candidate

__all__ = ["crossing_axes", "fp16_flush_below", "placement_words"]


def placement_words(cluster: Cluster, cand: Candidate, order: str = "tp-dp-pp") -> str:
    """Every axis of degree > 1, with "inside a node" or "across N nodes"."""
    links = group_links(cluster, cand.dp, cand.tp, cand.pp, order)
    return ", ".join(
        f"{axis}={getattr(cand, axis)} "
        + (f"across {gl.nodes} nodes" if gl.crosses_nodes else "inside a node")
        for axis, gl in links.items() if getattr(cand, axis) > 1
    )  # fmt: skip


def crossing_axes(cluster: Cluster, cand: Candidate, order: str = "tp-dp-pp") -> list[str]:
    """The axes (degree > 1) whose groups span nodes: the traffic on the slow network."""
    links = group_links(cluster, cand.dp, cand.tp, cand.pp, order)
    return [a for a, gl in links.items() if gl.crosses_nodes and getattr(cand, a) > 1]


def fp16_flush_below() -> float:
    """The largest power of two that an fp16 cast turns into exactly 0 (``2**-25``): every
    magnitude at or below it flushes; just above it rounds up to the smallest subnormal."""
    x = 1.0
    while torch.tensor(x, dtype=torch.float32).half().item() != 0.0:
        x /= 2
    return x
