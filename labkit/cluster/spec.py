"""What an emulated cluster is: N nodes of k ranks each, joined by links of a chosen speed.

Pure description, no processes: :class:`EmulatedCluster` is validated when built and again
against a world size (``cluster.check(world_size)``), before any process starts.

Node layout (like torchrun's node ranks): with ``world_size = nodes * ranks_per_node``, rank
``r`` lives on node ``r // ranks_per_node`` as local rank ``r % ranks_per_node``; the ranks of
one node are adjacent.

Link model: every node has ONE uplink of ``inter_bandwidth`` bytes/s in each direction, shared
by all its ranks. Ranks of one node talk at the machine's own (unshaped) speed.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass

MODES = ("auto", "netns", "software")


@dataclass(frozen=True)
class NodeTopology:
    """``nodes`` nodes of ``ranks_per_node`` adjacent ranks each."""

    nodes: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise ValueError(
                f"need nodes >= 1 and ranks_per_node >= 1, got nodes={self.nodes}, "
                f"ranks_per_node={self.ranks_per_node}"
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        """The node holding global ``rank``: ``rank // ranks_per_node``."""
        self._check_rank(rank)
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        """``rank``'s index inside its node: ``rank % ranks_per_node``."""
        self._check_rank(rank)
        return rank % self.ranks_per_node

    def ranks_of_node(self, node: int) -> list[int]:
        """The global ranks of ``node``, in order."""
        if not 0 <= node < self.nodes:
            raise ValueError(f"node must be in [0, {self.nodes}), got {node}")
        first = node * self.ranks_per_node
        return list(range(first, first + self.ranks_per_node))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")


@dataclass(frozen=True)
class EmulatedCluster:
    """``nodes`` emulated nodes whose uplinks carry ``inter_bandwidth`` bytes/s each direction.

    ``inter_latency``: seconds added per inter-node message. Honoured by the software model
    only: the kernel here lacks ``netem``, so the real-network mode emulates bandwidth, not
    latency (its latency is the machine's own, tens of microseconds).

    ``mode``: ``"netns"`` (real network: namespaces, veth, a bridge, ``tc`` shaping; needs root
    and ``ip``/``tc``), ``"software"`` (an alpha-beta delay model inside each rank; no root),
    or ``"auto"`` (netns where it works and no latency is asked, else software; see
    :meth:`resolved_mode`).
    """

    nodes: int
    inter_bandwidth: float
    inter_latency: float = 0.0
    mode: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 1:
            raise ValueError(f"nodes must be an int >= 1, got nodes={self.nodes!r}")
        if not isinstance(self.inter_bandwidth, int | float) or not self.inter_bandwidth > 0:
            raise ValueError(
                f"inter_bandwidth must be positive bytes/s, got {self.inter_bandwidth!r}"
            )
        if not isinstance(self.inter_latency, int | float) or not self.inter_latency >= 0:
            raise ValueError(f"inter_latency must be >= 0 seconds, got {self.inter_latency!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got mode={self.mode!r}")

    def topology(self, world_size: int) -> NodeTopology:
        """The node layout of ``world_size`` ranks; ValueError naming both when it does not fit."""
        if self.nodes > world_size:
            raise ValueError(f"more nodes than ranks: nodes={self.nodes} > world_size={world_size}")
        if world_size % self.nodes:
            raise ValueError(
                f"world_size={world_size} is not divisible by nodes={self.nodes}: every node "
                f"needs the same number of ranks"
            )
        return NodeTopology(self.nodes, world_size // self.nodes)

    def resolved_mode(self) -> str:
        """``"netns"`` or ``"software"``: what this cluster runs as on this machine."""
        if self.mode != "auto":
            return self.mode
        if self.inter_latency > 0:  # only the software model adds latency
            return "software"
        return "netns" if netns_unavailable() is None else "software"

    def check(self, world_size: int, backend: str | None = None) -> NodeTopology:
        """Everything a launch must know before starting a process; ValueError otherwise."""
        topology = self.topology(world_size)
        if self.mode == "netns":
            why = netns_unavailable()
            if why is not None:
                raise ValueError(
                    f"EmulatedCluster(mode='netns') cannot run here: {why}. "
                    f"Use mode='software' (no root needed) or mode='auto'."
                )
            if self.inter_latency > 0:
                raise ValueError(
                    f"EmulatedCluster(mode='netns') cannot add inter_latency="
                    f"{self.inter_latency!r}: this kernel has no netem. Use mode='software'."
                )
        if backend not in (None, "gloo"):
            raise ValueError(
                f"the emulated cluster carries gloo's CPU traffic; backend={backend!r} is not "
                f"supported (pass backend='gloo')"
            )
        return topology


@functools.cache
def netns_unavailable() -> str | None:
    """Why the real-network mode cannot run here, or None when it can (checked once: root,
    ``ip`` and ``tc`` on PATH, and a namespace that can really be added and removed)."""
    if os.geteuid() != 0:
        return f"it needs root (euid={os.geteuid()})"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found on PATH"
    name = f"lk-{uuid.uuid4().hex[:6]}-sw"  # the runs' scheme: a stale sweep would remove it
    added = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if added.returncode != 0:
        return f"'ip netns add' failed: {added.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None
