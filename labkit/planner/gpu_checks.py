"""This project's own GPU measurements as data, and the planner's predictions of them.

All on one NVIDIA H200 with torch 2.11.0+cu130, the capstone's GPT-2 1.3B step
(``labkit.measure.capstone``: bf16 parameters, fp32 master weights and Adam, SDPA attention,
sequence 2048) on one GPU:

* ``docs/gpu_check_h200.json`` (``benchmarks/gpu_check.py a``): the GPT-2 vocabulary of
  50,257 unpadded, without recompute at micro-batch 24 and with full recompute at 32;
* ``docs/gpu_push_h200.json`` (``gpu_check.py h``, two runs on two fresh machines): the step
  pushed further: the vocabulary padded to 50,304 (every dimension of the head's GEMM a
  multiple of 8), ``torch.compile`` of the blocks, micro-batches 8 and 16;
* ``docs/gpu_step_parts_h200.json`` (``gpu_check.py i``): one layer's GEMMs, attention and
  elementwise work, the head and the optimizer, each timed alone at micro-batch 24.

The planner predicts each as dp = tp = pp = 1 on the ``dgx-h200`` preset narrowed to one
GPU, with the ZeRO paper's 2 + 2 + 12 bytes a parameter (``MIXED_ADAM``). The memory
column is ``labkit.memory.estimate``'s peak (the one memory model). The planner has no
model of ``torch.compile``'s fusion: it predicts a compiled step as the eager one.
"""

from __future__ import annotations

from dataclasses import replace
from statistics import mean
from typing import NamedTuple

from labkit.measure.capstone import padded_vocab
from labkit.memory.estimate import GIB, TrainSetup, estimate
from labkit.memory.model import MIXED_ADAM
from labkit.models.gpt import preset
from labkit.planner.cluster import CLUSTERS, Cluster
from labkit.planner.plan import Candidate, predict
from labkit.planner.roofline import CHIPS
from labkit.planner.timing import attention_time, head_time, layer_time, optimizer_time

__all__ = ["H200_MEASURED", "H200_PARTS_MS", "Measured", "h200_parts", "h200_rows"]


class Measured(NamedTuple):
    recompute: str
    micro_batch: int
    vocab: int
    compiled: bool
    tokens_per_second: tuple[float, ...]  # one per run
    max_allocated_gib: float
    source: str


_PUSH = "docs/gpu_push_h200.json"
H200_MEASURED: tuple[Measured, ...] = (
    Measured("none", 24, 50257, False, (52964.7, 53129.9, 53138.8), 103.49,
             "docs/gpu_check_h200.json a_none; " + _PUSH + " base_none_mb24"),
    Measured("full", 32, 50257, False, (43611.7,), 42.13, "docs/gpu_check_h200.json a_full"),
    Measured("none", 24, 50304, False, (65574.7, 64681.0), 103.51, _PUSH + " pad64_none_mb24"),
    Measured("none", 24, 50304, True, (66814.4, 66172.0), 103.51,
             _PUSH + " pad64_none_mb24_compiled"),
    Measured("full", 32, 50304, False, (52518.7, 51732.5), 42.15, _PUSH + " pad64_full_mb32"),
    Measured("full", 32, 50304, True, (53449.7,), 42.15, _PUSH + " pad64_full_mb32_compiled"),
    Measured("none", 16, 50304, False, (63575.0,), 74.74, _PUSH + " pad64_none_mb16"),
    Measured("none", 8, 50304, False, (60887.8, 60136.4), 45.98, _PUSH + " pad64_none_mb8"),
)  # fmt: skip

# docs/gpu_step_parts_h200.json: milliseconds at micro-batch 24 x 2048 tokens, medians of 10
# (one layer's terms are forward + backward; attention under torch's default SDPA backend)
H200_PARTS_MS: dict[str, float] = {
    "gemm": 22.763, "attention": 3.640, "elementwise": 3.730, "elementwise, compiled": 3.070,
    "layer": 28.385, "layer, compiled": 28.093, "head (50,257)": 238.788,
    "head (50,304)": 47.166, "optimizer": 18.976,
}  # fmt: skip


def _one_h200() -> Cluster:
    return replace(CLUSTERS["dgx-h200"], gpus_per_node=1)


def h200_rows() -> list[dict[str, object]]:
    """Measured tokens/s (the mean of the runs) and peak memory against the planner's and
    the estimate's."""
    one = _one_h200()
    out = []
    for m in H200_MEASURED:
        cfg = preset("gpt2-1.3b", vocab_size=m.vocab)
        cand = Candidate(dp=1, tp=1, pp=1, micro_batch=m.micro_batch, recompute=m.recompute)
        pred = predict(cfg, one, m.micro_batch, cand, precision=MIXED_ADAM)
        setup = TrainSetup(precision="bf16", recompute=m.recompute, grad_chunk_params=64 * 2**20)
        est = estimate(cfg, setup, micro_batch=m.micro_batch).peak_allocated / GIB
        measured = mean(m.tokens_per_second)
        out.append({
            "recompute": m.recompute, "micro-batch": m.micro_batch, "vocab": m.vocab,
            "compiled": "yes" if m.compiled else "no", "runs": len(m.tokens_per_second),
            "measured tok/s": measured, "planner tok/s": pred.tokens_per_second,
            "error": pred.tokens_per_second / measured - 1,
            "measured GiB": m.max_allocated_gib, "estimate GiB": est,
            "planner GiB": pred.memory_total / GIB,
        })  # fmt: skip
    return out


def h200_parts() -> list[dict[str, object]]:
    """Each named term of the step, timed alone on the H200, against the planner's term
    (``timing.layer_time``, ``attention_time``, ``head_time``, ``optimizer_time``) on the
    same shapes. The planner's layer is Megatron's fused kernels; the measured one is eager
    PyTorch (separate LayerNorm, GELU and adds), which is why elementwise is its largest miss.
    """
    chip = CHIPS["h200"]
    cfg = preset("gpt2-1.3b")
    b, s, h, a = 24, cfg.block_size, cfg.n_embd, cfg.n_head
    vocab, padded = cfg.vocab_size, padded_vocab(cfg.vocab_size, 64)
    layer = layer_time(chip, b, s, h, a)
    att = sum(attention_time(chip, b, s, h, a, 1, "sdpa", True))
    planner = {
        "gemm": layer.gemm, "attention": att, "elementwise": layer.elementwise,
        "elementwise, compiled": layer.elementwise, "layer": layer.total,
        "layer, compiled": layer.total, "head (50,257)": head_time(chip, b, s, h, vocab),
        "head (50,304)": head_time(chip, b, s, h, padded),
        "optimizer": optimizer_time(chip, cfg.num_params(), MIXED_ADAM),
    }  # fmt: skip
    return [{"term": k, "measured ms": v, "planner ms": planner[k] * 1e3,
             "error": planner[k] * 1e3 / v - 1} for k, v in H200_PARTS_MS.items()]  # fmt: skip
