"""Megatron-LM's SC21 runs as data, and the planner at exactly their settings (pure arithmetic).

Narayanan et al. 2021 (arXiv 2104.04473) measured Table 1 with the settings NVIDIA's
reproduction scripts give (``examples/sc21/run_table_1.sh`` and ``CONFIG.sh`` in
github.com/NVIDIA/Megatron-LM): per row the micro-batch, the interleaved stages
(``--num-layers-per-virtual-pipeline-stage``: ``v = layers / (p x that)``) and the data-parallel
engine (``--DDP-impl torch`` in the four small rows, ``local`` above); for every run ``--fp16
--loss-scale 8192``, full recompute (``--recompute-method uniform``), sequence 2048,
vocabulary 51,200, and the scatter/gather of pipeline messages on (the default since
2021-02-16, section 4.1). :data:`TABLE1_SETTINGS` holds them beside :data:`MEGATRON_TABLE1`.

What those settings mean for the step, each priced from what the 2021 code did (read at the
commit of 2021-04-30 of Megatron-LM):

* ``--fp16`` without ``--accumulate-allreduce-grads-in-fp32``: the gradient buffer and its
  all-reduce are 16-bit (:data:`MEGATRON_2021_PRECISION`, 2 + 2 + 12 bytes a parameter);
* ``--DDP-impl torch``: PyTorch DDP's 25 MiB buckets all-reduce behind backward
  (``dp_overlap``); ``local``: one all-reduce after backward, exposed;
* the gradient accumulation: ``megatron/model/distributed.py`` adds each parameter's 16-bit
  gradient into its ``main_grad`` buffer in a backward hook, every micro-batch: three 16-bit
  streams a parameter (read both, write one), ``grad_accum`` (fused into the weight-gradient
  GEMM only in February 2022, "gradient accumulation fusion", after these runs);
* the scatter/gather (section 4.1): each pipeline message crosses as ``1/t`` per tp rank
  (``steptime``'s ``pp_comm``) and is re-assembled by an all-gather over the tp group on
  NVLink at every receive, forward and backward, per chunk: ``pp_gather``;
* the tp all-reduces at the all-reduce bus bandwidth NCCL reaches on 8 A100s over NVLink
  (``a100.nccl_allreduce_busbw`` in the hardware catalog, a measurement), not the data-sheet
  per-direction bandwidth.

No constant here is fitted to a row of Table 1. The rows' errors, the paper's layout's rank
among the planner's candidates and the sensitivity to the constants no measurement here gives
are in :mod:`labkit.planner.accuracy`.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import NamedTuple

from labkit.collectives.cost_model import ring_all_gather_time
from labkit.hardware import value
from labkit.memory.model import MIXED_ADAM, Precision
from labkit.models.gpt import GPTConfig
from labkit.planner.cluster import CLUSTERS, Cluster
from labkit.planner.flops import (
    MEGATRON_TABLE1,
    TABLE1_SEQ,
    TABLE1_VOCAB,
    TableRow,
    megatron_flops_per_iteration,
)
from labkit.planner.plan import Candidate, Prediction, plan, predict
from labkit.planner.roofline import chip_for, stream_time

__all__ = ["MEGATRON_2021_PRECISION", "SC21_SCRIPTS", "TABLE1_SETTINGS", "Sc21Setting",
           "megatron2021", "predict_2021", "sc21_cluster", "sc21_model", "table1_prediction",
           "table1_ranked", "tflops"]  # fmt: skip

SC21_SCRIPTS = ("github.com/NVIDIA/Megatron-LM examples/sc21/run_table_1.sh (MBS, GBS, "
                "--DDP-impl, --num-layers-per-virtual-pipeline-stage) and CONFIG.sh (--fp16 "
                "--loss-scale 8192, --clip-grad 1.0, seq 2048)")  # fmt: skip
# --fp16 without --accumulate-allreduce-grads-in-fp32 (CONFIG.sh): 16-bit params and the 16-bit
# main_grad buffer all-reduced as is, fp32 master weights and Adam's two moments
MEGATRON_2021_PRECISION: Precision = MIXED_ADAM
GRAD_ACCUM_STREAMS = 3  # main_grad.add_(grad): read main_grad, read grad, write main_grad
# bytes a parameter the 2021 fp16 optimizer step streams (megatron/optimizer/optimizer.py):
# 16-bit main_grad to fp32 (2 + 4), unscale and inf check in place (4 + 4), the grad norm (4),
# Adam (read weight, grad and two moments 16, write weight and moments 12), the fp32 weights
# back to 16-bit (4 + 2), the main_grad buffer zeroed (2): 54, where ``timing.optimizer_time``
# counts one fused step's 2 x 12 + 2 x 2 + 2 = 30
OPTIMIZER_2021_BYTES = 54


class Sc21Setting(NamedTuple):
    """One run's settings beyond Table 1's own columns (``run_table_1.sh``)."""

    micro_batch: int
    virtual: int  # interleaved stages per pipeline rank (1: plain 1F1B)
    ddp: str  # "torch": PyTorch DDP, overlapped; "local": Megatron's, after backward


# aligned with MEGATRON_TABLE1; v = layers / (p x --num-layers-per-virtual-pipeline-stage):
# 76B 60/(4x5) = 3, 145B 80/(8x5) = 2, 310B 96/(16x3) = 2, 530B 105/(35x1) = 3
TABLE1_SETTINGS: tuple[Sc21Setting, ...] = (
    Sc21Setting(16, 1, "torch"), Sc21Setting(16, 1, "torch"), Sc21Setting(16, 1, "torch"),
    Sc21Setting(8, 1, "torch"), Sc21Setting(4, 1, "local"), Sc21Setting(2, 3, "local"),
    Sc21Setting(2, 2, "local"), Sc21Setting(1, 2, "local"), Sc21Setting(1, 3, "local"),
    Sc21Setting(1, 1, "local"),
)  # fmt: skip


def sc21_cluster(gpus: int, nvlink_busbw: float | None = None) -> Cluster:
    """Selene's DGX A100 80GB nodes for ``gpus`` GPUs, NVLink at the all-reduce bus bandwidth
    NCCL reaches (``a100.nccl_allreduce_busbw``), or at ``nvlink_busbw``."""
    bw = value("a100.nccl_allreduce_busbw") if nvlink_busbw is None else nvlink_busbw
    return replace(CLUSTERS["dgx-a100-80gb"].with_nodes(max(1, gpus // 8)), intra_bandwidth=bw)


def sc21_model(layers: int, hidden: int, heads: int, vocab: int = TABLE1_VOCAB) -> GPTConfig:
    """Megatron 2021's GPT: explicit attention (fused softmax), sequence 2048, tied embedding."""
    return GPTConfig(vocab_size=vocab, block_size=TABLE1_SEQ, n_layer=layers, n_head=heads,
                     n_embd=hidden, attention="explicit")  # fmt: skip


def megatron2021(pred: Prediction, cfg: GPTConfig, cluster: Cluster) -> Prediction:
    """``pred`` with what Megatron 2021's code adds to ``steptime``'s terms (module
    docstring): its optimizer step's bytes (:data:`OPTIMIZER_2021_BYTES`), ``grad_accum``,
    the 16-bit gradient added into ``main_grad`` every micro-batch
    on every parameter the rank holds (HBM-bound), and ``pp_gather``, the tp all-gather that
    re-assembles each scattered pipeline message at its receiver (2 receives a micro-batch
    and chunk). Both sit on the critical path (same stream as compute; the 2021 p2p code
    synchronises after every exchange)."""
    c, m = pred.candidate, pred.micro_batches
    chip = chip_for(cluster.name, cluster.peak_flops, cluster.mem_bandwidth)
    h, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    params = (-(-L // c.pp) * (12 * h * h + 13 * h) + V * h) / c.tp  # the fullest rank's
    grad_bytes = MEGATRON_2021_PRECISION.grad_bytes
    extra = {
        "grad_accum": m * stream_time(chip, GRAD_ACCUM_STREAMS * grad_bytes * params),
        "optimizer": stream_time(chip, OPTIMIZER_2021_BYTES * params),
    }
    if c.pp > 1 and c.tp > 1:
        act = 2 * c.micro_batch * cfg.block_size * h  # one message, whole, 16-bit
        gather = ring_all_gather_time(act, c.tp, cluster.intra_latency,
                                      1 / cluster.intra_bandwidth)  # fmt: skip
        extra["pp_gather"] = 2 * m * c.virtual * gather
    return replace(pred, time={**pred.time, **extra})


def _row_flops(row: TableRow) -> float:
    return megatron_flops_per_iteration(row.batch, TABLE1_SEQ, row.layers, row.hidden,
                                        TABLE1_VOCAB)  # fmt: skip


def predict_2021(
    cfg: GPTConfig,
    gpus: int,
    global_batch: int,
    cand: Candidate,
    ddp: str = "local",
    nvlink_busbw: float | None = None,
) -> Prediction:
    """``cand`` on ``gpus`` of Selene as Megatron 2021 ran it (module docstring): 16-bit
    gradients and all-reduce, ``ddp`` "torch" (overlapped) or "local" (after backward), the
    2021 optimizer step, gradient accumulation and the pipeline's scatter/gather."""
    if ddp not in ("torch", "local"):
        raise ValueError(f"ddp={ddp!r}: expected 'torch' or 'local'")
    cluster = sc21_cluster(gpus, nvlink_busbw)
    pred = predict(cfg, cluster, global_batch, cand, precision=MEGATRON_2021_PRECISION,
                   dp_overlap=ddp == "torch")  # fmt: skip
    return megatron2021(pred, cfg, cluster)


def table1_prediction(i: int, nvlink_busbw: float | None = None) -> Prediction:
    """Row ``i`` of Table 1 predicted at the run's own settings (``TABLE1_SETTINGS``)."""
    row, st = MEGATRON_TABLE1[i], TABLE1_SETTINGS[i]
    cand = Candidate(row.gpus // (row.tp * row.pp), row.tp, row.pp, st.micro_batch,
                     virtual=st.virtual)  # fmt: skip
    cfg = sc21_model(row.layers, row.hidden, row.heads)
    return predict_2021(cfg, row.gpus, row.batch, cand, st.ddp, nvlink_busbw)


def tflops(i: int, pred: Prediction) -> float:
    """TFLOP/s per GPU of Table 1's row ``i`` at ``pred``'s step (the paper's 96-factor count)."""
    return _row_flops(MEGATRON_TABLE1[i]) / (pred.step_seconds * MEGATRON_TABLE1[i].gpus) / 1e12


@functools.cache
def table1_ranked(i: int) -> tuple[Prediction, ...]:
    """Every candidate of row ``i``'s search space (t, p; micro-batch 1-16; 1-3 interleaved
    stages) priced with the run's own engine and recipe, in the planner's order of choice
    (fits with 5% free first, then risky fits; fastest first)."""
    row, st = MEGATRON_TABLE1[i], TABLE1_SETTINGS[i]
    cfg = sc21_model(row.layers, row.hidden, row.heads)
    cluster = sc21_cluster(row.gpus)
    preds = plan(cfg, cluster, row.batch, micro_batches=(1, 2, 4, 8, 16), virtual=(1, 2, 3),
                 precision=MEGATRON_2021_PRECISION, dp_overlap=st.ddp == "torch")  # fmt: skip
    priced = [megatron2021(p, cfg, cluster) for p in preds]
    return tuple(sorted(priced, key=lambda r: (not r.fits, r.risky, r.step_seconds,
                                                r.candidate.tp * r.candidate.pp)))  # fmt: skip
