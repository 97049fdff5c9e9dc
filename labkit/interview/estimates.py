"""Back-of-envelope numbers for interview answers, built on labkit's own models.

Every function is plain arithmetic (no processes) over labkit's memory model
(:mod:`labkit.memory.model`), alpha-beta costs (:mod:`labkit.collectives.cost_model`) and
model definitions. Hardware numbers are STATED assumptions (datasheet-class figures), named
here once so an answer can say "assuming ...".

* DDP step prediction (S2): compute ``3 * F * b / (peak * mfu)`` (forward F, backward 2F per
  sample, Kaplan et al. 2020), gradient ring all-reduce ``2(p-1) alpha + 2(p-1)/p * D * beta``,
  of which only what does not fit behind backward is exposed.
* Strong scaling keeps the global batch (efficiency ``t1 / (p * tp)``), weak scaling keeps the
  per-GPU batch (efficiency ``t1 / tp``) (K9).
* Young (1974) / Daly (2006): checkpoint every ``sqrt(2 * C * M)`` seconds for save time C and
  mean time between failures M; the fraction of time lost is about ``C/tau + tau/(2M)`` (K11).
* The data-parallel ladder (P3): DDP, then ZeRO-1, 2, 3; model parallelism only when none fits.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from labkit.collectives.cost_model import AlphaBeta, ring_all_reduce_time
from labkit.memory.model import MIXED_ADAM, STAGES, Precision, model_states

__all__ = [
    "LINKS",
    "GPU_PEAK_FLOPS",
    "GPU_MEMORY",
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
]

# Stated link assumptions: alpha (s per message), beta (s per byte) of one ring hop.
LINKS = {
    "NVLink": AlphaBeta(5e-6, 1 / 150e9),  # A100 NVLink 3, ~150 GB/s achievable per direction
    "PCIe": AlphaBeta(10e-6, 1 / 12e9),  # PCIe 4.0 x16 through the host bridge, ~12 GB/s
    "InfiniBand": AlphaBeta(5e-6, 1 / 20e9),  # HDR 200 Gb/s per node
    "Ethernet25": AlphaBeta(30e-6, 1 / 2.5e9),  # 25 Gb/s cloud networking
}
GPU_PEAK_FLOPS = 312e12  # A100 dense bf16, datasheet
GPU_MEMORY = 80e9  # A100 80 GB


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

    With ``overlap`` the all-reduce runs during backward (2/3 of compute) and only the excess
    shows; without it all of it adds to the step.
    """
    if p < 1 or batch_per_gpu < 1 or not 0 < mfu <= 1:
        raise ValueError(
            f"need p >= 1, batch_per_gpu >= 1, 0 < mfu <= 1; got {p}, {batch_per_gpu}, {mfu}"
        )
    compute = 3 * fwd_flops_per_sample * batch_per_gpu / (peak_flops * mfu)
    comm = ring_all_reduce_time(params * grad_bytes, p, link.alpha, link.beta) if p > 1 else 0.0
    exposed = max(0.0, comm - 2 / 3 * compute) if overlap else comm
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


def first_fitting_stage(
    psi: float,
    world_size: int,
    activation_bytes: float,
    gpu_bytes: float = GPU_MEMORY,
    precision: Precision = MIXED_ADAM,
    headroom: float = 0.9,
) -> str:
    """The first of DDP, ZeRO-1, -2, -3 whose model states plus activations fit in
    ``headroom * gpu_bytes``; ``"model parallel"`` when none does (then, and only then, tensor
    or pipeline parallelism: pitfall P3)."""
    for stage in STAGES:
        if (
            model_states(stage, psi, world_size, precision).total + activation_bytes
            <= headroom * gpu_bytes
        ):
            return stage
    return "model parallel"


def sum_order_changes_bits(n: int = 1 << 16, seed: int = 0) -> bool:
    """Does a float32 sum split over 2 ranks differ, bit for bit, from the same sum over 4?

    An all-reduce adds partial sums in an order set by the world size and algorithm; float
    addition is not associative, so the bits change (K10).
    """
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 1e3
    two = torch.stack([c.sum() for c in x.chunk(2)]).sum()
    four = torch.stack([c.sum() for c in x.chunk(4)]).sum()
    return bool(two != four)
