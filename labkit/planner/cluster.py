"""A cluster as the planner sees it: nodes of GPUs, and two classes of link.

Inside a node GPUs talk over NVLink/NVSwitch; between nodes over InfiniBand (or Ethernet).
Each link class is an alpha-beta pair (Hockney: a message of n bytes takes alpha + n / bandwidth).
Bandwidths are *per GPU*, one direction, as a ring collective sees them (NCCL's busbw): a DGX
A100 has 8 HDR InfiniBand adapters of 200 Gb/s, one per GPU, so 25 GB/s per GPU between nodes,
and NVLink 3 at 300 GB/s per direction per GPU inside the node. Which link a group rides
follows from where its ranks sit (``links.py``: global rank r is on node r // gpus_per_node).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    # default is the A100 80GB's 2,039 GB/s
    mem_bandwidth: float = 2.039e12

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


CLUSTERS: dict[str, Cluster] = {
    # Selene, the machine of Narayanan et al. 2021: DGX A100 80GB nodes, 312 TFLOP/s bf16/fp16.
    "dgx-a100-80gb": Cluster(
        nodes=1,
        gpus_per_node=8,
        memory_bytes=80 * GB,
        peak_flops=312e12,
        intra_bandwidth=300 * GB,
        inter_bandwidth=25 * GB,
        name="DGX A100 80GB",
        mem_bandwidth=2.039e12,  # A100 80GB SXM data sheet: 2,039 GB/s HBM2e
    ),
    # The same A100 nodes on a slow network: one 100 Gb/s Ethernet port per node (12.5 GB/s,
    # shared by 8 GPUs: 1.56 GB/s each) and TCP's higher latency; NVLink unchanged inside.
    "a100-80gb-eth100": Cluster(
        nodes=1,
        gpus_per_node=8,
        memory_bytes=80 * GB,
        peak_flops=312e12,
        intra_bandwidth=300 * GB,
        inter_bandwidth=12.5 * GB / 8,
        inter_latency=30e-6,
        name="A100 80GB, 1 x 100 Gb/s Ethernet per node",
        mem_bandwidth=2.039e12,
    ),
    # DGX H100: NVLink 4 (450 GB/s per direction per GPU), 8 x 400 Gb/s NDR (50 GB/s per GPU),
    # 989 TFLOP/s dense bf16 (SXM).
    "dgx-h100-80gb": Cluster(
        nodes=1,
        gpus_per_node=8,
        memory_bytes=80 * GB,
        peak_flops=989e12,
        intra_bandwidth=450 * GB,
        inter_bandwidth=50 * GB,
        name="DGX H100 80GB",
        mem_bandwidth=3.35e12,  # H100 SXM data sheet: 3.35 TB/s HBM3
    ),
    # DGX H200: the H100's die and links with 141 GB of HBM3e at 4.8 TB/s (data sheet); the
    # card this project measured reports 139.8 GiB to torch (docs/gpu_check_h200.json).
    "dgx-h200": Cluster(
        nodes=1,
        gpus_per_node=8,
        memory_bytes=139.8 * 2**30,
        peak_flops=989e12,
        intra_bandwidth=450 * GB,
        inter_bandwidth=50 * GB,
        name="DGX H200 141GB",
        mem_bandwidth=4.8e12,
    ),
}
