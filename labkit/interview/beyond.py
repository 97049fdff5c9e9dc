"""Pure formulas for the ids beyond the original cards: long context, experts, TP overlap.

Notebooks 15 (context parallelism) and 16 (experts) build and measure them; notebook 13's short
walkthroughs need only this arithmetic, so it stands alone (no import of those packages).

**Long context (K13).** Per layer and sequence, Korthikanti et al. (2022) count
``s b h (34 + 5 a s / h)`` bytes of activations in 16 bits: the ``5 a s^2 b`` part is the
attention scores, their softmax and its dropout mask, quadratic in ``s``. A fused attention
kernel (FlashAttention, torch's SDPA) never stores them (it recomputes tiles in backward),
leaving the linear ``34 s b h``. Context parallelism over ``c`` GPUs splits the sequence: each
keeps ``s / c`` tokens' activations, and passes K and V blocks around a ring (ring attention:
``2 (c-1)/c`` of the layer's K and V, ``2 s b h`` bytes each at 16 bits, per pass).

**Mixture of experts (K14).** An MoE layer replaces the MLP (``8 h^2`` parameters with a 4x
hidden) by ``E`` expert MLPs and a router; each token goes to ``top_k`` of them. Parameters
grow with ``E``, the FLOPs per token with ``top_k`` only: the training cost is ``6 N_active D``
(Kaplan's ``6 N D`` over the active parameters), the memory that of all ``N``. Expert
parallelism sends every token to its experts and back: two all-to-alls of ``top_k b s h``
activations per MoE layer, forward and backward alike.

**Tensor-parallel overlap (K16).** A sequence-parallel all-gather (or reduce-scatter) of ``C``
seconds next to the GEMM of ``g`` seconds that needs it, cut into ``t - 1`` ring steps each under
a ``1/t`` chunk of the GEMM, leaves ``max(0, C - (t - 1) g / t)`` exposed: one chunk never has a
transfer under it (:func:`tp_overlap_exposed`, the planner's own formula; notebook 18 builds it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from labkit.planner.tp_overlap import decomposed_exposed as tp_overlap_exposed

__all__ = [
    "MoeCounts",
    "attention_activation_bytes",
    "fp8_range_bits",
    "fp8_step_seconds",
    "moe_counts",
    "ring_attention_bytes",
    "tp_overlap_exposed",
]


def attention_activation_bytes(
    seq: int, hidden: int, heads: int, micro_batch: int = 1, *, fused: bool = False, cp: int = 1
) -> float:
    """One layer's stored activations (bytes, 16-bit), Korthikanti's count; ``fused`` drops the
    ``5 a s^2 b`` score terms (SDPA, FlashAttention); ``cp`` GPUs of context parallelism keep
    ``s / cp`` tokens each (scores ``s/cp x s``: a query block against every key)."""
    if min(seq, hidden, heads, micro_batch, cp) < 1 or seq % cp:
        raise ValueError(
            f"need positive sizes and cp dividing seq, got s={seq} h={hidden} a={heads} "
            f"b={micro_batch} cp={cp}"
        )
    local = seq // cp
    linear = 34 * local * micro_batch * hidden
    scores = 0.0 if fused else 5 * heads * local * seq * micro_batch
    return linear + scores


def ring_attention_bytes(seq: int, hidden: int, cp: int, micro_batch: int = 1) -> float:
    """Bytes each GPU receives per layer's forward in ring attention: the other ``cp - 1``
    blocks of K and V, each ``(s / cp) b h`` elements of 2 bytes, twice (K and V)."""
    if cp < 1 or seq % cp:
        raise ValueError(f"cp must divide seq, got cp={cp}, seq={seq}")
    return 2 * 2 * (cp - 1) * (seq // cp) * micro_batch * hidden


@dataclass(frozen=True)
class MoeCounts:
    total_params: float  # what memory holds
    active_params: float  # what one token's forward multiplies by
    all_to_all_bytes: float  # per MoE layer and micro-batch, forward: dispatch + combine

    def train_flops(self, tokens: float) -> float:
        """``6 N_active D``: each token touches only its experts."""
        return 6 * self.active_params * tokens


def moe_counts(
    layers: int, hidden: int, experts: int, top_k: int, *, vocab: int = 51_200,
    tokens_per_batch: int = 2048, moe_every: int = 1,
) -> MoeCounts:
    """A GPT of ``layers`` x ``hidden`` whose MLPs (every ``moe_every``-th) are ``experts``
    expert MLPs of ``8 h^2`` each; attention ``4 h^2`` per layer, embedding ``V h``."""
    if min(layers, hidden, experts, top_k, moe_every) < 1 or top_k > experts:
        raise ValueError(
            f"need positive sizes and 1 <= top_k <= experts, got L={layers} h={hidden} "
            f"E={experts} k={top_k} every={moe_every}"
        )
    mlp = 8 * hidden * hidden
    moe_layers = layers // moe_every
    dense = layers * 4 * hidden * hidden + (layers - moe_layers) * mlp + vocab * hidden
    router = moe_layers * hidden * experts if experts > 1 else 0  # one expert: the dense model
    total = dense + router + moe_layers * experts * mlp
    active = dense + router + moe_layers * top_k * mlp
    a2a = 2 * 2 * top_k * tokens_per_batch * hidden  # dispatch and combine, 2 bytes each
    return MoeCounts(total, active, a2a)


def fp8_range_bits(fmt: str, subnormals: bool = True) -> float:
    """FP8 (K15): the powers of two an 8-bit format spans, log2(max / smallest), down to its
    smallest subnormal (or normal). e4m3: 448 down to 2^-9; e5m2: 57,344 down to 2^-16."""
    from labkit.precision.fp8.formats import FORMATS

    if fmt not in ("e4m3", "e5m2"):
        raise ValueError(f"fmt={fmt!r}; expected 'e4m3' or 'e5m2'")
    f = FORMATS[fmt]
    return math.log2(f.max / (f.min_subnormal if subnormals else f.min_normal))


def fp8_step_seconds(step: float, gemm: float, gemm_speedup: float = 2.0) -> float:
    """FP8 (K15): a step of ``step`` seconds, ``gemm`` of them in the linears' GEMMs, when
    only those run ``gemm_speedup`` x faster (Amdahl: the rest of the step stays)."""
    if not 0 <= gemm <= step or gemm_speedup <= 0:
        raise ValueError(f"need 0 <= gemm <= step and a positive speed-up, got step={step}, "
                         f"gemm={gemm}, gemm_speedup={gemm_speedup}")  # fmt: skip
    return step - gemm + gemm / gemm_speedup
