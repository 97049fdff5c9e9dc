"""What FP8 buys one plan, by the planner's own terms: GEMMs at the FP8 peak, halved
ZeRO-3 gathers, and the saved activations at one byte.

* **GEMMs.** The roofline (:mod:`labkit.planner.roofline`) prices each of a layer's GEMMs
  at the card's FP8 tensor-core peak from the hardware catalog (``<card>.peak_fp8``: twice
  the bf16 one on H100/H200; A100 has no FP8 tensor cores and is refused) with one-byte
  operands, which is the memory side at twice the bandwidth. The layer's GEMM term scales by
  ``gemm_fp8 / gemm_bf16``; under full recompute the rerun forward's GEMMs too (one of the
  three GEMMs of equal FLOPs, so a third of the saving again). Attention (flash kernels in
  bf16), elementwise work and the head stay as they were, as in TE and torchao recipes. The
  casts are taken as fused into the kernels before them (TE fuses them into LayerNorm/GeLU;
  torch.compile does for torchao), so they cost nothing here: an unfused cast would add 3
  bytes an element.
* **Bubble.** The pipeline's idle slots are a multiple of the slowest rank's micro-batch
  time, so they shrink with the compute.
* **ZeRO-3 all-gathers** (FSDP2 + torchao's FP8 all-gather): the parameters travel at one
  byte (``Precision.param_bytes = 1`` on the dp side of :func:`step_time`); ZeRO-1/2's one
  gather of updated weights and every reduce stay 16/32-bit.
* **Memory**: the linears' saved inputs at one byte, less the FP8 weight copies each layer
  keeps for its backward (:mod:`labkit.memory.fp8`; neither under full recompute, where a
  layer keeps only its input and the rerun forward casts again).
* **MFU** is counted against the bf16 peak, as the field reports it (the FP8-peak figure is
  given beside it).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from labkit.hardware import value
from labkit.memory.fp8 import fp8_activation_saving, fp8_weight_copy_bytes
from labkit.models.gpt import GPTConfig
from labkit.planner.cluster import Cluster
from labkit.planner.flops import megatron_flops_per_iteration
from labkit.planner.memory import MEGATRON_MIXED, candidate_memory, planner_parts
from labkit.planner.roofline import Chip, chip_for
from labkit.planner.space import Candidate
from labkit.planner.steptime import step_time
from labkit.planner.timing import layer_time

__all__ = ["fp8_chip", "fp8_gain"]

CARDS = ("h200", "h100")


def fp8_chip(cluster: Cluster) -> tuple[Chip, Chip, float]:
    """``(bf16 chip, FP8 chip, FP8 peak)``: the FP8 chip has the catalog's FP8 peak and twice
    the bandwidth (operands of one byte stream in half the time)."""
    low = cluster.name.lower()
    card = next((c for c in CARDS if c in low), None)
    if card is None:
        raise ValueError(f"cluster {cluster.name!r}: no FP8 tensor-core peak in the catalog "
                         f"(FP8 GEMMs need Hopper or later: {CARDS})")  # fmt: skip
    chip = chip_for(cluster.name, cluster.peak_flops, cluster.mem_bandwidth)
    peak = value(f"{card}.peak_fp8")
    return chip, chip.with_peak(peak, 2 * cluster.mem_bandwidth), peak


def fp8_gain(cfg: GPTConfig, cluster: Cluster, global_batch: int, cand: Candidate,
             dp_overlap: bool = True) -> dict[str, Any]:  # fmt: skip
    """bf16 against FP8 for one plan: step seconds by term, MFU (bf16 peak; and FP8 peak),
    activation, FP8 weight-copy and ZeRO-3 gather bytes per GPU (module docstring)."""
    chip, chip8, peak8 = fp8_chip(cluster)
    m = global_batch // (cand.dp * cand.micro_batch)
    s, h, a, b, t = cfg.block_size // cand.cp, cfg.n_embd, cfg.n_head, cand.micro_batch, cand.tp
    mem = candidate_memory(cfg, cluster, cand, m, precision=MEGATRON_MIXED)
    kw = dict(params_per_gpu=float(mem.params_per_gpu), dp_overlap=dp_overlap)
    base = step_time(cfg, cluster, cand, m, precision=MEGATRON_MIXED, **kw)  # type: ignore[arg-type]
    common = dict(tp=t, sp=cand.sp, recompute=cand.recompute, cp=cand.cp)
    g16 = layer_time(chip, b, s, h, a, **common).gemm  # type: ignore[arg-type]
    g8 = layer_time(chip8, b, s, h, a, **common).gemm  # type: ignore[arg-type]
    terms = dict(base.terms)
    saved = base.parts["gemm"] * (1 - g8 / g16)
    if cand.recompute == "full":  # the rerun forward: 1 of each linear's 3 equal GEMMs
        saved *= 4 / 3
    terms["compute"] = base.terms["compute"] - saved
    if "bubble" in terms and base.terms["compute"] > 0:
        terms["bubble"] = base.terms["bubble"] * terms["compute"] / base.terms["compute"]
    if cand.zero == 3:  # FSDP's FP8 all-gather: parameters at one byte on the dp side
        fp8_side = replace(MEGATRON_MIXED, param_bytes=1)
        terms["dp_comm"] = step_time(cfg, cluster, cand, m, precision=fp8_side,
                                     **kw).terms["dp_comm"]  # type: ignore[arg-type]  # fmt: skip
    flops = megatron_flops_per_iteration(global_batch, cfg.block_size, cfg.n_layer, h,
                                         cfg.vocab_size, recompute=False)  # fmt: skip
    n = cluster.world_size
    blocks = -(-cfg.n_layer // cand.pp)
    act16 = planner_parts(mem)["activations"]
    act8 = act16 - fp8_activation_saving(s, b, h, tp=t, sp=cand.sp,
                                         recompute=cand.recompute) * blocks * cand.pp  # fmt: skip
    sec16, sec8 = base.seconds, sum(terms.values())
    return {
        "bf16": base.terms, "fp8": terms, "seconds": (sec16, sec8), "speedup": sec16 / sec8,
        "gemm_ratio": g8 / g16, "mfu_bf16_peak": (flops / (sec16 * n * cluster.peak_flops),
                                                  flops / (sec8 * n * cluster.peak_flops)),
        "mfu_fp8_peak": flops / (sec8 * n * peak8), "activations": (act16, act8),
        "weight_copies": 0.0 if cand.recompute == "full" else fp8_weight_copy_bytes(h, blocks, t),
        "gather_bytes": (float(mem.params_per_gpu) * 2, float(mem.params_per_gpu))
        if cand.zero == 3 else (0.0, 0.0),
    }  # fmt: skip
