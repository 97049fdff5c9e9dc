"""A launch on an emulated cluster: the launcher builds the network, each rank joins its node.

Caller side, :func:`cluster_network` (a context manager around the whole job): in netns mode
it sweeps networks of dead runs, creates this run's, and removes it when the job is over,
whatever the way out (success, a failed rank, a timeout, an interrupt; ``atexit`` too).

Rank side, :class:`ClusterRun` (shipped to the ranks with the job): ``enter(rank)`` runs after
the rendezvous store's connection is made (it stays in the root namespace, where the agent's
store listens on 127.0.0.1) and before ``init_process_group``, so gloo's sockets open inside
the node's namespace; ``install(run_dir)`` runs after it and puts the software link model in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from labkit.cluster import netns, software
from labkit.cluster.spec import EmulatedCluster, NodeTopology


@dataclass(frozen=True)
class ClusterRun:
    """One launch's cluster: its spec, node layout, resolved mode and (netns) network plan."""

    cluster: EmulatedCluster
    topology: NodeTopology
    mode: str  # "netns" | "software"
    plan: netns.NetnsPlan | None = None

    def enter(self, rank: int) -> None:
        """Move this rank into its node's namespace (netns mode; nothing in software mode)."""
        if self.plan is not None:
            netns.enter(self.plan, self.topology.node_of(rank))

    def install(self, run_dir: Path) -> None:
        """Put the link model into this rank (software mode; nothing in netns mode)."""
        if self.mode == "software":
            software.install(self.cluster, self.topology, Path(run_dir) / "cluster-links.bin")


@contextlib.contextmanager
def cluster_network(cluster: EmulatedCluster, world_size: int) -> Iterator[ClusterRun]:
    """The network of one launch, alive for the ``with`` block (see module docstring)."""
    topology = cluster.topology(world_size)
    mode = cluster.resolved_mode()
    if mode != "netns":
        yield ClusterRun(cluster, topology, mode)
        return
    netns.sweep_stale()
    plan = netns.NetnsPlan.new(cluster.nodes, cluster.inter_bandwidth)
    netns.create(plan)
    try:
        yield ClusterRun(cluster, topology, mode, plan)
    finally:
        netns.remove(plan)
