"""This project's own GPU measurements as data, and the planner's predictions of them.

``docs/gpu_check_h200.json`` (``benchmarks/gpu_check.py`` section a, torch 2.11.0+cu130, one
NVIDIA H200): the capstone's GPT-2 1.3B step (``labkit.measure.capstone``: bf16 parameters,
fp32 master weights and Adam, SDPA attention, the GPT-2 vocabulary of 50,257 unpadded) on one
GPU. The planner predicts it as dp = tp = pp = 1 on the ``dgx-h200`` preset narrowed to one
GPU, with the ZeRO paper's 2 + 2 + 12 bytes a parameter (``MIXED_ADAM``: the gradients stay
bf16). The memory column is ``labkit.memory.estimate``'s peak (the one memory model).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from labkit.memory.estimate import GIB, TrainSetup, estimate
from labkit.memory.model import MIXED_ADAM
from labkit.models.gpt import preset
from labkit.planner.cluster import CLUSTERS
from labkit.planner.plan import Candidate, predict

__all__ = ["H200_MEASURED", "Measured", "h200_rows"]


class Measured(NamedTuple):
    recompute: str
    micro_batch: int
    tokens_per_second: float
    max_allocated_gib: float
    source: str


H200_MEASURED: tuple[Measured, ...] = (
    Measured("none", 24, 52964.7, 103.49, "docs/gpu_check_h200.json a_none"),
    Measured("full", 32, 43611.7, 42.13, "docs/gpu_check_h200.json a_full"),
)


def h200_rows() -> list[dict[str, object]]:
    """Measured tokens/s and peak memory against the planner's and the estimate's."""
    cfg = preset("gpt2-1.3b")
    one = replace(CLUSTERS["dgx-h200"], gpus_per_node=1)
    out = []
    for m in H200_MEASURED:
        cand = Candidate(dp=1, tp=1, pp=1, micro_batch=m.micro_batch, recompute=m.recompute)
        pred = predict(cfg, one, m.micro_batch, cand, precision=MIXED_ADAM)
        setup = TrainSetup(precision="bf16", recompute=m.recompute, grad_chunk_params=64 * 2**20)
        est = estimate(cfg, setup, micro_batch=m.micro_batch).peak_allocated / GIB
        out.append({
            "recompute": m.recompute, "micro-batch": m.micro_batch,
            "measured tok/s": m.tokens_per_second, "planner tok/s": pred.tokens_per_second,
            "error": pred.tokens_per_second / m.tokens_per_second - 1,
            "measured GiB": m.max_allocated_gib, "estimate GiB": est,
            "planner GiB": pred.memory_total / GIB,
        })  # fmt: skip
    return out
