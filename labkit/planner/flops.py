"""Megatron's FLOPs per iteration, and the published table the planner is proven against.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", section 5.1 / Appendix: a GPT with ``l`` layers, hidden size ``h``, sequence ``s``,
vocabulary ``V`` and batch ``B`` does, per iteration *with full activation recomputation*::

    F = 96 B s l h^2 (1 + s / (6h) + V / (16 l h))

Where 96 comes from: a layer's forward is 24 B s h^2 (QKV 6, attention projection 2, MLP 16,
each "2 FLOPs per multiply-add" x B s h^2) plus 4 B s^2 h for the attention scores and their
product with V; backward is twice the forward, recompute adds one more forward: 4 x 24 = 96.
The logit layer adds 2 B s h V forward (x3 with backward, not recomputed) = 6 B s h V, which
is the V / (16 l h) term. Without recomputation the factor is 72, not 96.

Achieved FLOP/s per GPU is F / (iteration time x GPUs); training time for T tokens of a
P-parameter model on n GPUs at X FLOP/s each is about 8 T P / (n X) (section 5.1).
"""

from __future__ import annotations

from typing import NamedTuple

from labkit.hardware import value

__all__ = [
    "MEGATRON_TABLE1",
    "TableRow",
    "achieved_flops_per_gpu",
    "megatron_flops_per_iteration",
    "megatron_params",
    "selective_hardware_flops",
    "training_days",
]


def megatron_flops_per_iteration(
    batch: int, seq: int, layers: int, hidden: int, vocab: int, *, recompute: bool = True
) -> float:
    """FLOPs of one training iteration (see the module docstring for the derivation)."""
    if min(batch, seq, layers, hidden, vocab) < 1:
        raise ValueError(
            f"need positive sizes, got B={batch} s={seq} l={layers} h={hidden} V={vocab}"
        )
    factor = 96 if recompute else 72
    B, s, L, h, V = batch, seq, layers, hidden, vocab  # the paper's l is L here
    return factor * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h) * (96 / factor))


def selective_hardware_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Korthikanti et al.'s hardware FLOPs with selective recompute:
    ``72 B s l h^2 (1 + s/3h + V/12lh)``, the model FLOPs with the attention core's ``s/6h``
    term counted twice. It is the count that reproduces the README's HFU column (to 0.1
    point); adding only the recomputed core's forward, ``4 B s^2 h`` a layer, gives 22B's HFU
    as 42.4% where the README says 43.7% (``korthikanti_readme_check``, negative control)."""
    model = megatron_flops_per_iteration(batch, seq, layers, hidden, vocab, recompute=False)
    return model + 12 * batch * seq * seq * hidden * layers


def megatron_params(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """The paper's parameter count 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))."""
    L, h = layers, hidden
    return 12 * L * h * h * (1 + 13 / (12 * h) + (vocab + seq) / (12 * L * h))


def achieved_flops_per_gpu(flops_per_iteration: float, seconds: float, gpus: int) -> float:
    if seconds <= 0 or gpus < 1:
        raise ValueError(f"need seconds > 0 and gpus >= 1, got {seconds}, {gpus}")
    return flops_per_iteration / (seconds * gpus)


def training_days(tokens: float, params: float, gpus: int, flops_per_gpu: float) -> float:
    """8 T P / (n X) seconds, in days: forward 2TP, backward 4TP, recompute 2TP."""
    return 8 * tokens * params / (gpus * flops_per_gpu) / 86400


class TableRow(NamedTuple):
    """One row of Narayanan et al. 2021, Table 1 (A100 80GB, V = 51,200, s = 2,048)."""

    params_billion: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops_per_gpu: float  # achieved teraFLOP/s per GPU
    percent_of_peak: int
    aggregate_pflops: float


TABLE1_VOCAB, TABLE1_SEQ, A100_PEAK = 51_200, 2_048, value("a100.peak_bf16")

# Transcribed from the paper's Table 1 (weak scaling, 1.7B to 1T parameters).
MEGATRON_TABLE1: tuple[TableRow, ...] = (
    TableRow(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44, 4.4),
    TableRow(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44, 8.8),
    TableRow(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46, 18.2),
    TableRow(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 34.6),
    TableRow(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 70.8),
    TableRow(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 143.8),
    TableRow(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 227.1),
    TableRow(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 297.4),
    TableRow(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 410.2),
    TableRow(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 502.0),
)
