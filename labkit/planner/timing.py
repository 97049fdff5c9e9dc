"""The compute side of a step: one layer, the head and the optimizer on one GPU, each term named.

Per transformer layer and micro-batch of ``T = b s`` tokens on one tensor-parallel rank
(hidden h, heads a, head size d = h / a, t ranks), every GEMM is timed by its shape on the
card's roofline (:mod:`roofline`):

``gemm``         forward QKV ``(T, 3h/t, h)``, projection ``(T, h, h/t)``, fc ``(T, 4h/t, h)``,
                 fc2 ``(T, h, 4h/t)``; backward each GEMM's two: the input gradient
                 ``(T, k, n)`` and the weight gradient ``(k, n, T)``.
``attention``    explicit (Megatron 2021: two batched GEMMs, ``b a/t`` of ``(s, s, d)`` and
                 ``(s, d, s)`` forward, four backward, plus the fused scale-mask-softmax and
                 dropout streaming the ``b a/t s^2`` scores: 9 bytes an element forward, 11
                 backward); or flash (SDPA): no score matrix in HBM, ``4 b s^2 h / t`` FLOPs
                 forward (half of it under a causal mask, whose masked tiles are skipped) and
                 2.5x that backward (the kernel recomputes the scores), at the card's published
                 flash-attention efficiency.
``elementwise``  memory-bound: two LayerNorms (read and write h, 2 bytes each: 4h), two fused
                 bias-dropout-adds (output, residual, result, 1-byte mask: 7h) and the fused
                 bias-GeLU on 4h/t (16h/t) = ``22h + 16h/t`` bytes a token forward; the 22h is
                 split t ways under sequence parallelism; backward streams twice the bytes
                 (the output gradient and the saved input in, the input gradient out).
``recompute``    the forward again, per policy: none; selective (the attention core only, and
                 nothing under flash, whose backward already recomputes it); full (the whole
                 layer's forward).
``head``         on the last stage: the logits ``(T, V/t, h)`` forward and its two backward
                 GEMMs, and the cross-entropy streaming 24 bytes a logit (fp32 softmax and its
                 gradient).
``optimizer``    Adam over the GPU's parameter shard: it reads and writes the optimizer state
                 and the master weights (2 x optimizer bytes), reads and zeroes the gradients
                 (2 x gradient bytes) and writes the 16-bit parameters: memory-bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from labkit.memory.model import RECOMPUTE, Precision
from labkit.planner.roofline import Chip, gemm_time, stream_time

__all__ = ["LayerTime", "attention_time", "head_time", "layer_time", "optimizer_time"]

SOFTMAX_FWD_BYTES, SOFTMAX_BWD_BYTES = 9, 11  # per score element (module docstring)
CE_BYTES = 24  # per logit element, forward and backward
FLASH_BWD_FACTOR = 2.5  # backward FLOPs / forward FLOPs of a flash kernel (it recomputes S)
ATTENTION_KINDS = ("sdpa", "explicit")


@dataclass(frozen=True)
class LayerTime:
    """Seconds one layer takes for one micro-batch on one tp rank, by named term."""

    gemm: float
    attention: float
    elementwise: float
    recompute: float

    @property
    def total(self) -> float:
        return self.gemm + self.attention + self.elementwise + self.recompute

    def parts(self) -> dict[str, float]:
        return {"gemm": self.gemm, "attention": self.attention,
                "elementwise": self.elementwise, "recompute": self.recompute}  # fmt: skip


def _gemms(chip: Chip, shapes: Sequence[tuple[float, ...]]) -> tuple[float, float]:
    """(forward, backward) seconds of ``(m, n, k[, batch])`` GEMMs: backward is the input
    gradient ``(m, k, n)`` and the weight gradient ``(k, n, m)`` of each."""
    full = [(x[0], x[1], x[2], x[3] if len(x) > 3 else 1.0) for x in shapes]
    fwd = sum(gemm_time(chip, m, n, k, g) for m, n, k, g in full)
    bwd = sum(gemm_time(chip, m, k, n, g) + gemm_time(chip, k, n, m, g) for m, n, k, g in full)
    return fwd, bwd


def attention_time(chip: Chip, b: int, s: int, h: int, a: int, t: int, kind: str,
               causal: bool, cp: int = 1) -> tuple[float, float]:  # fmt: skip
    """(forward, backward) seconds of the attention core (module docstring); ``s`` queries
    against ``s cp`` keys under context parallelism (the ring's blocks, zigzag-balanced)."""
    heads, d = b * a / t, h / a
    if kind == "sdpa":
        flops = 4 * b * s * s * cp * h / t * (0.5 if causal else 1.0)
        fwd = flops / (chip.peak_flops * chip.flash_fwd)
        return fwd, FLASH_BWD_FACTOR * flops / (chip.peak_flops * chip.flash_bwd)
    scores = heads * s * s  # elements of the (b, a/t, s, s) score tensor
    fwd = gemm_time(chip, s, s, d, heads) + gemm_time(chip, s, d, s, heads)
    bwd = 3 * gemm_time(chip, s, d, s, heads) + gemm_time(chip, s, s, d, heads)
    return (fwd + stream_time(chip, SOFTMAX_FWD_BYTES * scores),
            bwd + stream_time(chip, SOFTMAX_BWD_BYTES * scores))  # fmt: skip


def layer_time(chip: Chip, b: int, s: int, h: int, a: int, *, tp: int = 1, sp: bool = False,
               recompute: str = "none", attention: str = "sdpa", causal: bool = True,
               cp: int = 1, mlp: Sequence[tuple[float, ...]] | None = None,
               ) -> LayerTime:  # fmt: skip
    """One layer's forward, backward and recompute on one of ``tp`` ranks (module docstring).
    ``cp``: ``s`` is this rank's share of a ``s cp`` sequence (ring attention: flash kernels
    only); ``mlp``: GEMM shapes ``(m, n, k, batch)`` replacing the MLP's two (a MoE layer,
    :func:`labkit.planner.cp_ep.moe_mlp_shapes`)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r}; expected one of {RECOMPUTE}")
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention={attention!r}: expected one of {ATTENTION_KINDS}")
    if cp > 1 and attention != "sdpa":
        raise ValueError(f"cp={cp} needs a flash-style kernel (attention='sdpa'), got "
                         f"{attention!r}: ring attention never forms the score matrix")  # fmt: skip
    if tp < 1 or min(b, s, h, a) < 1 or h % tp or a % tp:
        raise ValueError(f"need positive sizes and tp dividing h and a, got b={b} s={s} "
                         f"h={h} a={a} tp={tp}")  # fmt: skip
    T, t = b * s, tp
    shapes: list[tuple[float, ...]] = [(T, 3 * h / t, h), (T, h, h / t)]
    shapes += [(T, 4 * h / t, h), (T, h, 4 * h / t)] if mlp is None else list(mlp)
    g_fwd, g_bwd = _gemms(chip, shapes)
    a_fwd, a_bwd = attention_time(chip, b, s, h, a, t, attention, causal, cp)
    e_fwd = stream_time(chip, T * (22 * h / (t if sp else 1) + 16 * h / t))
    if recompute == "full":
        again = g_fwd + a_fwd + e_fwd
    elif recompute == "selective" and attention == "explicit":
        again = a_fwd
    else:
        again = 0.0
    return LayerTime(g_fwd + g_bwd, a_fwd + a_bwd, 3 * e_fwd, again)


def head_time(chip: Chip, b: int, s: int, h: int, vocab: int, tp: int = 1) -> float:
    """The logits GEMM forward and backward and the cross-entropy, on one of ``tp`` ranks."""
    T, shard = b * s, vocab / tp
    fwd, bwd = _gemms(chip, [(T, shard, h)])
    return fwd + bwd + stream_time(chip, CE_BYTES * T * shard)


def optimizer_time(chip: Chip, params: float, precision: Precision) -> float:
    """Adam's step over ``params`` parameters (module docstring): memory-bound."""
    per = 2 * precision.optim_bytes + 2 * precision.grad_bytes + precision.param_bytes
    return stream_time(chip, per * params)
