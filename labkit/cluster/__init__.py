"""An emulated cluster on one machine: N nodes of k ranks, slow links between the nodes.

``labkit.launch(fn, world_size=8, cluster=EmulatedCluster(nodes=4, inter_bandwidth=50e6))``
runs ``fn`` on 4 nodes x 2 ranks. Ranks of one node talk at the machine's speed; traffic
between nodes crosses each node's one shared uplink of ``inter_bandwidth`` bytes/s.

Two ways to emulate it (``cluster.resolved_mode()`` says which a run uses):

* ``netns`` (root, ``ip``/``tc``; :mod:`labkit.cluster.netns`): real network namespaces joined
  by veth pairs and a bridge, shaped with ``tbf``. Bandwidth only: no netem here, so no latency.
* ``software`` (no root; :mod:`labkit.cluster.software`): point-to-point messages between nodes
  are delayed by an alpha-beta model of the shared links; torch's native collectives spanning
  nodes are charged a modeled flat-ring cost.

Techniques never see the emulation: they see a slower network. :func:`probe` measures it.
Read: ``spec.py`` (the description), ``run.py`` (launch integration), ``netns.py``,
``software.py``, ``probe.py``.
"""

from labkit.cluster.probe import LinkProbe, ProbeResult, probe, probe_links
from labkit.cluster.spec import EmulatedCluster, NodeTopology

__all__ = [
    "EmulatedCluster",
    "LinkProbe",
    "NodeTopology",
    "ProbeResult",
    "probe",
    "probe_links",
]
