"""A cluster as the planner sees it: nodes of GPUs, and two classes of link.

Inside a node GPUs talk over NVLink/NVSwitch; between nodes over InfiniBand (or Ethernet).
Each link class is an alpha-beta pair (Hockney: a message of n bytes takes alpha + n / bandwidth).
Bandwidths are *per GPU*, one direction, as a ring collective sees them: a DGX A100 has one
HDR InfiniBand adapter per GPU (``a100.nics_per_node``, ``a100.nic_bandwidth``) between nodes,
and NVLink 3 (``a100.nvlink_per_direction``) inside the node; every figure is read from the
hardware catalog (:mod:`labkit.hardware`), where its source is. Which link a group rides
follows from where its ranks sit (``links.py``: global rank r is on node r // gpus_per_node).
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.hardware import value

__all__ = ["CLUSTERS", "Cluster"]

GB = 1e9


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``gpus_per_node`` GPUs. Bandwidths in bytes/s per GPU, latencies in seconds."""

    nodes: int
    gpus_per_node: int
    memory_bytes: float
    peak_flops: float  # dense 16-bit FLOP/s per GPU
    intra_bandwidth: float
    inter_bandwidth: float
    intra_latency: float = 5e-6
    inter_latency: float = 10e-6
    name: str = ""
    # HBM bytes/s per GPU, data sheet (the roofline's memory side, ``roofline.py``); the
    # default is the A100 80GB's (``a100.hbm_bandwidth``)
    mem_bandwidth: float = value("a100.hbm_bandwidth")

    def __post_init__(self) -> None:
        fields = {
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "memory_bytes": self.memory_bytes,
            "peak_flops": self.peak_flops,
            "intra_bandwidth": self.intra_bandwidth,
            "inter_bandwidth": self.inter_bandwidth,
            "mem_bandwidth": self.mem_bandwidth,
        }
        bad = {k: v for k, v in fields.items() if not v > 0}
        if bad:
            raise ValueError(
                f"cluster values must be > 0, got {bad} (cluster {self.name or fields})"
            )
        if self.intra_latency < 0 or self.inter_latency < 0:
            raise ValueError(
                f"latencies must be >= 0, got intra {self.intra_latency}, "
                f"inter {self.inter_latency}"
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def with_nodes(self, nodes: int) -> Cluster:
        from dataclasses import replace

        return replace(self, nodes=nodes)


def _node(card: str, nodes: int = 1, **changes: object) -> Cluster:
    """A DGX-class node of 8 ``card`` GPUs, every figure from the hardware catalog
    (``labkit/data/files/hardware.json``, with sources): NVLink per direction inside, one NIC
    per GPU between nodes (its bandwidth is each GPU's share of the uplink)."""
    from dataclasses import replace

    base = Cluster(
        nodes=nodes,
        gpus_per_node=8,
        memory_bytes=value(f"{card}.memory"),
        peak_flops=value(f"{card}.peak_bf16"),
        intra_bandwidth=value(f"{card}.nvlink_per_direction"),
        inter_bandwidth=value(f"{card}.nic_bandwidth"),
        intra_latency=value("link.nvlink_latency"),
        inter_latency=value("link.ib_latency"),
        mem_bandwidth=value(f"{card}.hbm_bandwidth"),
    )
    return replace(base, **changes)  # type: ignore[arg-type]


CLUSTERS: dict[str, Cluster] = {
    # Selene, the machine of Narayanan et al. 2021: DGX A100 80GB nodes (8 HDR NICs a node).
    "dgx-a100-80gb": _node("a100", name="DGX A100 80GB"),
    # The same A100 nodes on a slow network: one 100 Gb/s Ethernet port per node, shared by
    # its 8 GPUs (each GPU's share is 1/8 of it), and TCP's higher latency; NVLink inside.
    "a100-80gb-eth100": _node(
        "a100", inter_bandwidth=value("link.ethernet100") / 8,
        inter_latency=value("link.ethernet_latency"),
        name="A100 80GB, 1 x 100 Gb/s Ethernet per node",
    ),  # fmt: skip
    # DGX H100: NVLink 4, 8 x 400 Gb/s NDR (one per GPU), 989 TFLOP/s dense bf16 (SXM).
    "dgx-h100-80gb": _node("h100", name="DGX H100 80GB"),
    # DGX H200: the H100's die and links with 141 GB of HBM3e; the card this project
    # measured reports 139.8 GiB to torch (h200.memory_seen), which the planner plans with.
    "dgx-h200": _node("h200", memory_bytes=value("h200.memory_seen"), name="DGX H200 141GB"),
}
