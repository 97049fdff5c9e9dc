"""The memory ladder P3 and A3 climb before any model parallelism (pitfall P3).

Each rung is one more thing a data-parallel job can do to fit, cheapest first (Rajbhandari
et al. 2020 for ZeRO, Korthikanti et al. 2022 for recompute, Ren et al. 2021 for ZeRO-Offload):
DDP; ZeRO-1, -2, -3 (shard the optimizer state, the gradients, the parameters); ZeRO-3 with
selective then full activation recompute (one more forward: about a third more compute);
ZeRO-3 with full recompute and the optimizer state offloaded to host memory (the optimizer step
runs on the CPU, its states cross PCIe every step). Only when none fits does the model need
tensor or pipeline parallelism. Every rung is priced by :func:`labkit.memory.estimate.estimate`
(bf16 + fp32 Adam, SDPA attention), not by a typed activation figure.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.hardware import value
from labkit.memory.estimate import MemoryEstimate, TrainSetup, estimate
from labkit.memory.model import MIXED_ADAM, STAGES, Precision, model_states
from labkit.models.gpt import GPTConfig

__all__ = ["RUNGS", "STAGE_LADDER", "Rung", "first_fitting_stage", "first_rung", "memory_ladder",
           "offload_seconds"]

# (name, ZeRO stage, recompute, optimizer offloaded)
RUNGS: tuple[tuple[str, str, str, bool], ...] = (
    ("DDP", "ddp", "none", False),
    ("ZeRO-1", "zero1", "none", False),
    ("ZeRO-2", "zero2", "none", False),
    ("ZeRO-3", "zero3", "none", False),
    ("ZeRO-3 + selective recompute", "zero3", "selective", False),
    ("ZeRO-3 + full recompute", "zero3", "full", False),
    ("ZeRO-3 + full recompute + optimizer offload", "zero3", "full", True),
)


@dataclass(frozen=True)
class Rung:
    name: str
    estimate: MemoryEstimate
    fits: bool

    @property
    def gpu_bytes(self) -> float:
        return self.estimate.total


def memory_ladder(cfg: GPTConfig, gpus: int, card_bytes: float,
                  micro_batch: int = 1) -> list[Rung]:  # fmt: skip
    """Every rung's per-GPU estimate of ``cfg`` data-parallel over ``gpus`` cards of
    ``card_bytes``, one ``micro_batch`` of ``cfg.block_size`` tokens per GPU."""
    if gpus < 1 or card_bytes <= 0 or micro_batch < 1:
        raise ValueError(f"need gpus >= 1, card_bytes > 0, micro_batch >= 1; got {gpus}, "
                         f"{card_bytes}, {micro_batch}")  # fmt: skip
    out: list[Rung] = []
    for name, zero, recompute, offload in RUNGS:
        e = estimate(cfg, TrainSetup(micro_batch=micro_batch, dp=gpus, zero=zero,
                                     recompute=recompute, offload_optimizer=offload))  # fmt: skip
        if recompute != "none" and out and e.activations >= out[-1].estimate.activations:
            continue  # a recompute that stores nothing less (selective under SDPA): no rung
        out.append(Rung(name, e, e.fits(card_bytes)))
    return out


def offload_seconds(psi: float, gpus: int, host_link: float, elem_bytes: int = 2) -> float:
    """Host-link seconds a step of the offload rung adds (ZeRO-Offload, Ren et al. 2021): each
    GPU sends its ``psi / gpus`` 16-bit gradients to the host and takes the updated 16-bit
    parameters back, one after the other (the CPU's Adam step runs between them, not priced)."""
    return 2 * elem_bytes * psi / gpus / host_link


def first_rung(cfg: GPTConfig, gpus: int, card_bytes: float, micro_batch: int = 1) -> Rung | None:
    """The cheapest rung that fits; None: only then tensor or pipeline parallelism."""
    return next((r for r in memory_ladder(cfg, gpus, card_bytes, micro_batch) if r.fits), None)


# The quiz's ladder when activations are given as figures (no model shape): the stages, then
# the two rungs that spend compute or the host link before any model parallelism.
STAGE_LADDER = (*STAGES, "zero3 + recompute", "zero3 + recompute + offload", "model parallel")


def first_fitting_stage(
    psi: float,
    world_size: int,
    activation_bytes: float,
    gpu_bytes: float | None = None,
    precision: Precision = MIXED_ADAM,
    headroom: float = 0.9,
    recompute_bytes: float | None = None,
) -> str:
    """The first of DDP, ZeRO-1, -2, -3 whose model states plus activations fit in
    ``headroom * gpu_bytes`` (an A100's memory by default). Given ``recompute_bytes`` (the
    activations under full recompute), ZeRO-3 with them, then also with the optimizer state on
    the host (ZeRO-Offload: ``(param + grad bytes) psi / N`` stay), come before ``"model
    parallel"``; without it ``"model parallel"`` means only "no ZeRO stage alone fits"."""
    budget = headroom * (value("a100.memory") if gpu_bytes is None else gpu_bytes)
    for stage in STAGES:
        if model_states(stage, psi, world_size, precision).total + activation_bytes <= budget:
            return stage
    if recompute_bytes is not None:
        z3 = model_states("zero3", psi, world_size, precision)
        if z3.total + recompute_bytes <= budget:
            return "zero3 + recompute"
        if z3.total - z3.optimizer_state + recompute_bytes <= budget:
            return "zero3 + recompute + offload"
    return "model parallel"
