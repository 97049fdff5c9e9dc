"""Back-of-envelope numbers for interview answers, built on labkit's own models.

Every function is plain arithmetic (no processes) over labkit's memory model
(:mod:`labkit.memory.model`), alpha-beta costs (:mod:`labkit.collectives.cost_model`) and
model definitions. Hardware numbers come from the one catalog (:mod:`labkit.hardware`), by
name, so an answer can say "assuming ..." and cite where the figure comes from.

* DDP step prediction (S2): compute ``3 * F * b / (peak * mfu)`` (forward F, backward 2F per
  sample, Kaplan et al. 2020), gradient ring all-reduce ``2(p-1) alpha + 2(p-1)/p * D * beta``,
  of which only what does not fit behind backward is exposed.
* Strong scaling keeps the global batch (efficiency ``t1 / (p * tp)``), weak scaling keeps the
  per-GPU batch (efficiency ``t1 / tp``) (K9).
* Young (1974) / Daly (2006): checkpoint every ``sqrt(2 * C * M)`` seconds for save time C and
  mean time between failures M; the fraction of time lost is about ``C/tau + tau/(2M)`` (K11).
* The data-parallel ladder (P3): DDP, then ZeRO-1, 2, 3; model parallelism only when none fits.
* Time to train (S7): ``6 N D`` FLOPs for N parameters and D tokens (Kaplan et al. 2020;
  8 N D with full recomputation; :func:`labkit.planner.budget.training_flops`) at a stated
  MFU of a stated peak, in days, GPU-hours and money, for a model the planner has not
  planned (S6 uses the planner's own ``run_budget`` at its predicted step).
* HSDP against FSDP/ZeRO-3 (A2): memory from :func:`labkit.memory.model.model_states`, step
  communication from :mod:`labkit.collectives.cost_model` on two link classes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from labkit.collectives.cost_model import (
    AlphaBeta,
    flat_ring_two_level_time,
    ring_all_reduce_time,
)
from labkit.hardware import value
from labkit.interview.ladder import first_fitting_stage
from labkit.memory.model import model_states
from labkit.planner.budget import training_flops
from labkit.planner.steptime import BUCKET_BYTES

__all__ = [
    "LINKS",
    "LINK_SOURCES",
    "NICS_PER_NODE",
    "GPU_PEAK_FLOPS",
    "GPU_MEMORY",
    "PRICE_PER_GPU_HOUR",
    "resnet50_counts",
    "DdpPrediction",
    "predict_ddp_step",
    "strong_efficiency",
    "weak_efficiency",
    "young_daly_interval",
    "checkpoint_overhead",
    "cluster_mtbf_hours",
    "workers_needed",
    "first_fitting_stage",
    "sum_order_changes_bits",
    "TrainBudget",
    "time_to_train",
    "hsdp_vs_fsdp",
]

# Link assumptions: alpha (s per message), beta (s per byte) of one ring hop, every figure
# read from the hardware catalog (labkit/data/files/hardware.json, sources there). The 8x8
# A100 cluster of S6, S7 and A2 is one cluster: NVLink 3 inside a node, one 200 Gb/s HDR NIC
# per GPU between nodes ("InfiniBand" is one NIC; a node has NICS_PER_NODE of them).
LINKS = {
    "NVLink": AlphaBeta(value("link.nvlink_latency"), 1 / value("a100.nvlink_per_direction")),
    "PCIe": AlphaBeta(value("link.pcie4_latency"), 1 / value("link.pcie4_x16")),
    "InfiniBand": AlphaBeta(value("link.ib_latency"), 1 / value("a100.nic_bandwidth")),
    "Ethernet25": AlphaBeta(value("link.ethernet_latency"), 1 / value("link.ethernet25")),
}
LINK_SOURCES = {"NVLink": "a100.nvlink_per_direction", "PCIe": "link.pcie4_x16",
                "InfiniBand": "a100.nic_bandwidth", "Ethernet25": "link.ethernet25"}  # fmt: skip
NICS_PER_NODE = int(value("a100.nics_per_node"))
GPU_PEAK_FLOPS = value("a100.peak_bf16")
GPU_MEMORY = value("a100.memory")
PRICE_PER_GPU_HOUR = value("assume.price_per_gpu_hour")  # stated in the catalog


@functools.cache
def resnet50_counts() -> tuple[int, int]:
    """(parameters, forward FLOPs per 224x224 image) of the real ResNet-50, counted on ``meta``."""
    from torch.utils.flop_counter import FlopCounterMode

    from labkit.models.resnet import resnet50

    with torch.device("meta"):
        model = resnet50()
        x = torch.empty(1, 3, 224, 224)
        with FlopCounterMode(display=False) as counter:
            model(x)
    return sum(p.numel() for p in model.parameters()), int(counter.get_total_flops())


@dataclass(frozen=True)
class DdpPrediction:
    """Seconds per step on ``p`` GPUs, and throughput."""

    p: int
    batch_per_gpu: int
    compute: float
    comm: float
    exposed_comm: float

    @property
    def step(self) -> float:
        return self.compute + self.exposed_comm

    @property
    def samples_per_second(self) -> float:
        return self.p * self.batch_per_gpu / self.step


def predict_ddp_step(
    params: float,
    fwd_flops_per_sample: float,
    batch_per_gpu: int,
    p: int,
    link: AlphaBeta,
    *,
    peak_flops: float = GPU_PEAK_FLOPS,
    mfu: float = 0.2,
    grad_bytes: int = 4,
    overlap: bool = True,
) -> DdpPrediction:
    """One DDP step: compute, the gradient ring all-reduce, and the part of it left exposed.

    Defaults are stated assumptions for a ResNet-50 under AMP on A100s. ``grad_bytes=4``:
    autocast keeps the parameters, hence their gradients, in fp32, and DDP all-reduces them
    in fp32 unless a compression hook (``fp16_compress_hook``) casts them: pass 2 for that.
    ``mfu=0.2``: about what NVIDIA's published A100 ResNet-50 AMP throughput (a few thousand
    images/s with a DALI input pipeline) implies at 3 x 8.2 GFLOPs per image; 0.4 would be
    twice what a real input pipeline sustains.

    With ``overlap`` the all-reduce runs in buckets of ``BUCKET_BYTES`` during backward (2/3
    of compute): the excess shows, and never less than the last bucket, which can only start
    when backward ends (the planner's DDP model, :mod:`labkit.planner.steptime`: one model of
    overlap for S2 and the planner); without it all of it adds to the step.
    """
    if p < 1 or batch_per_gpu < 1 or not 0 < mfu <= 1:
        raise ValueError(
            f"need p >= 1, batch_per_gpu >= 1, 0 < mfu <= 1; got {p}, {batch_per_gpu}, {mfu}"
        )
    compute = 3 * fwd_flops_per_sample * batch_per_gpu / (peak_flops * mfu)
    comm = ring_all_reduce_time(params * grad_bytes, p, link.alpha, link.beta) if p > 1 else 0.0
    buckets = max(1, math.ceil(params * grad_bytes / BUCKET_BYTES))
    exposed = max(comm / buckets, comm - 2 / 3 * compute) if overlap else comm
    return DdpPrediction(p, batch_per_gpu, compute, comm, exposed)


def strong_efficiency(t1: float, tp: float, p: int) -> float:
    """Fixed global batch: ideal ``tp = t1 / p``; efficiency ``t1 / (p * tp)``."""
    return t1 / (p * tp)


def weak_efficiency(t1: float, tp: float) -> float:
    """Fixed per-GPU batch: ideal ``tp = t1``; efficiency ``t1 / tp``."""
    return t1 / tp


def young_daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Young/Daly's first-order optimum: ``sqrt(2 * C * M)`` seconds between checkpoints."""
    if save_seconds <= 0 or mtbf_seconds <= 0:
        raise ValueError(
            f"need save_seconds > 0 and mtbf_seconds > 0, got {save_seconds}, {mtbf_seconds}"
        )
    return math.sqrt(2 * save_seconds * mtbf_seconds)


def checkpoint_overhead(interval: float, save_seconds: float, mtbf_seconds: float) -> float:
    """Fraction of time lost: saving (``C / tau``) plus redoing half an interval per failure."""
    return save_seconds / interval + interval / (2 * mtbf_seconds)


def cluster_mtbf_hours(per_gpu_mtbf_hours: float, gpus: int) -> float:
    """Independent failures: a job on N GPUs fails N times as often as one GPU."""
    return per_gpu_mtbf_hours / gpus


def workers_needed(samples_per_second: float, seconds_per_sample: float) -> int:
    """Loader processes to keep up: each prepares ``1 / seconds_per_sample`` samples/s."""
    return math.ceil(samples_per_second * seconds_per_sample)


def sum_order_changes_bits(n: int = 1 << 16, seed: int = 0) -> bool:
    """Does a float32 sum split over 2 ranks differ, bit for bit, from the same sum over 4?

    An all-reduce adds partial sums in an order set by the world size and algorithm; float
    addition is not associative, so the bits change (K10).
    """
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 1e3
    two = torch.stack([c.sum() for c in x.chunk(2)]).sum()
    four = torch.stack([c.sum() for c in x.chunk(4)]).sum()
    return bool(two != four)


@dataclass(frozen=True)
class TrainBudget:
    """A whole run: FLOPs, wall-clock and what it costs."""

    flops: float
    seconds: float
    gpus: int
    price_per_gpu_hour: float

    @property
    def days(self) -> float:
        return self.seconds / 86400

    @property
    def gpu_hours(self) -> float:
        return self.seconds * self.gpus / 3600

    @property
    def cost(self) -> float:
        return self.gpu_hours * self.price_per_gpu_hour


def time_to_train(
    params: float,
    tokens: float,
    gpus: int,
    *,
    mfu: float = 0.4,
    peak_flops: float = GPU_PEAK_FLOPS,
    price_per_gpu_hour: float = PRICE_PER_GPU_HOUR,
    recompute: str = "none",
) -> TrainBudget:
    """The training FLOPs of :func:`labkit.planner.budget.training_flops` (``6 N D``; full
    recompute adds ``2 N D``) at ``mfu`` of ``peak_flops`` on each of ``gpus``: for a run
    with no planner prediction of its step (the planner's ``run_budget`` takes one). Stated
    defaults: 40% MFU (a well-tuned dense LLM run on A100s), ``assume.price_per_gpu_hour``."""
    if gpus < 1 or not 0 < mfu <= 1:
        raise ValueError(f"need gpus >= 1 and 0 < mfu <= 1; got {gpus}, {mfu}")
    flops = training_flops(params, tokens, recompute)["total"]
    return TrainBudget(flops, flops / (gpus * peak_flops * mfu), gpus, price_per_gpu_hour)


def hsdp_vs_fsdp(
    psi: float, nodes: int, gpus_per_node: int, intra: AlphaBeta, inter: AlphaBeta,
    elem_bytes: int = 2, nics_per_node: int = 1, units: int = 1,
) -> dict[str, dict[str, float]]:
    """Per GPU: model-state bytes, bytes through each node's uplink per step, and seconds of
    the step's parameter/gradient collectives, for FSDP/ZeRO-3 over all ``n k`` GPUs against
    HSDP (shard inside a node of ``k``, replicate across the ``n`` nodes).

    FSDP: all-gather the parameters twice (forward, backward) and reduce-scatter the gradients
    once, each half of a flat ring all-reduce over all GPUs: ``1.5 x`` that ring's time
    (NCCL's channels spread its crossing over the node's ``nics_per_node`` NICs, ``inter``
    being one NIC), and ``3 (p-1)/p D`` bytes through each node's uplink (``D = elem_bytes *
    psi``). HSDP: the same three collectives inside the node (fast link), then an all-reduce
    across nodes of each GPU's ``D/k`` gradient shard, the ``k`` shards sharing the node's NICs
    (``ceil(k / nics)`` flows a NIC): ``2 (n-1)/n D`` bytes through the uplink. Memory: HSDP's
    states are sharded ``k`` ways, not ``n k``. Both gather and reduce per wrapped unit (a
    block): ``units`` collectives of ``D/units`` each, every one paying its ring's latencies.
    """
    p, k, n = nodes * gpus_per_node, gpus_per_node, nodes
    d, u = elem_bytes * psi, elem_bytes * psi / units  # whole model, one unit
    fsdp_s = units * 1.5 * flat_ring_two_level_time(u, n, k, intra, inter, nics_per_node)
    sharing = -(-k // nics_per_node)  # HSDP's cross-node flows per NIC
    hsdp_s = units * (1.5 * ring_all_reduce_time(u, k, *intra) + (
        ring_all_reduce_time(u / k, n, inter.alpha, inter.beta * sharing) if n > 1 else 0.0
    ))
    return {
        "fsdp": {
            "states": model_states("zero3", psi, p).total,
            "uplink_bytes": 3 * (p - 1) / p * d if n > 1 else 0.0,
            "seconds": fsdp_s,
        },
        "hsdp": {
            "states": model_states("zero3", psi, k).total,
            "uplink_bytes": 2 * (n - 1) / n * d,
            "seconds": hsdp_s,
        },
    }
