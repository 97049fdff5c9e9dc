"""The analytic memory model of ZeRO (Rajbhandari et al. 2019, arXiv 1910.02054, section 5).

Model states for Psi parameters trained with Adam in mixed precision: fp16 parameters (2Psi),
fp16 gradients (2Psi) and K*Psi bytes of optimizer state, K = 12 for Adam (fp32 master
weights 4 + momentum 4 + variance 4). With N data-parallel ranks, per rank:

============  ==========================  ============================
stage         bytes per rank              Psi=7.5B, K=12, N=64
============  ==========================  ============================
DDP           (2 + 2 + K) Psi             120 GB
ZeRO-1 (os)   2Psi + 2Psi + K Psi / N     31.4 GB
ZeRO-2 (os+g) 2Psi + (2 + K) Psi / N      16.6 GB
ZeRO-3 (all)  (2 + 2 + K) Psi / N         1.88 GB
============  ==========================  ============================

Pure fp32 training (what labkit runs on CPU) has no separate master copy: parameters 4,
gradients 4, Adam moments 8 bytes per parameter, the same formulas with (4, 4, 8).

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation", eq. 1): one
transformer layer stores ``s*b*h*(34 + 5*a*s/h)`` bytes in 16-bit training without
parallelism, for sequence length s, micro-batch b, hidden size h and a attention heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal

__all__ = [
    "STAGES",
    "Precision",
    "MIXED_ADAM",
    "FP32_ADAM",
    "ModelStates",
    "model_states",
    "RECOMPUTE",
    "activation_bytes_per_layer",
    "activation_bytes_per_layer_sized",
    "transformer_activation_bytes",
    "communication_bytes",
    "zero_table1",
    "paper_round",
]

STAGES = ("ddp", "zero1", "zero2", "zero3")


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each model state, and per gradient element on the wire."""

    param_bytes: int
    grad_bytes: int
    optim_bytes: int  # the paper's K
    # bytes per gradient element on the wire (the data-parallel reduce): None = the gradients'
    # own dtype (Megatron's fp32 main_grad buffer reduces in fp32), 2 = a 16-bit reduce
    reduce_bytes: int | None = None

    def __post_init__(self) -> None:
        if min(self.param_bytes, self.grad_bytes, self.optim_bytes) < 0:
            raise ValueError(f"bytes per parameter must be >= 0, got {self}")
        if self.reduce_bytes is not None and self.reduce_bytes not in (2, 4):
            raise ValueError(f"reduce_bytes must be 2, 4 or None, got {self.reduce_bytes}")

    @property
    def wire_bytes(self) -> int:
        """Bytes per gradient element the data-parallel reduction sends: the one precision
        choice the memory side (``grad_bytes``) and the time side (bytes on the wire) share."""
        return self.grad_bytes if self.reduce_bytes is None else self.reduce_bytes

    @property
    def mixed(self) -> bool:
        """16-bit parameters and gradients: the optimizer step upcasts gradients to fp32."""
        return self.param_bytes < 4 and self.grad_bytes < 4


MIXED_ADAM = Precision(2, 2, 12)  # the paper's setting
FP32_ADAM = Precision(4, 4, 8)  # plain fp32 Adam: moments only, params are the master copy


@dataclass(frozen=True)
class ModelStates:
    """Predicted bytes per rank of each model state."""

    parameters: float
    gradients: float
    optimizer_state: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state


def model_states(
    stage: str, psi: float, world_size: int, precision: Precision = MIXED_ADAM
) -> ModelStates:
    """Bytes per rank for ``stage`` in ``STAGES`` (see the module table)."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
    if world_size < 1 or psi < 0:
        raise ValueError(
            f"need world_size >= 1 and psi >= 0, got world_size={world_size}, psi={psi}"
        )
    n = world_size
    p, g, k = precision.param_bytes * psi, precision.grad_bytes * psi, precision.optim_bytes * psi
    shard_p = stage == "zero3"
    shard_g = stage in ("zero2", "zero3")
    shard_os = stage != "ddp"
    return ModelStates(p / n if shard_p else p, g / n if shard_g else g, k / n if shard_os else k)


RECOMPUTE = ("none", "selective", "full")


def activation_bytes_per_layer(
    seq: int,
    batch: int,
    hidden: int,
    heads: int,
    *,
    tp: int = 1,
    sp: bool = False,
    recompute: str = "none",
) -> float:
    """Activation bytes one transformer layer keeps for backward, per tensor-parallel rank.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
    Models", Table 2 (16-bit activations, 1-byte dropout masks; s sequence, b micro-batch,
    h hidden, a heads, t tensor-parallel size)::

        no parallelism                     sbh (34 + 5as/h)
        tensor parallel                    sbh (10 + 24/t + 5as/(ht))
        tensor + sequence parallel         sbh (34/t + 5as/(ht))
        tensor parallel + selective        sbh (10 + 24/t)
        tensor + sequence + selective      sbh (34/t)
        full recompute                     2sbh   (only the layer's input is kept)

    Where the 34 comes from (the paper's section 4.1): attention keeps 11sbh (QKV input 2,
    Q and K 4, V 2, output-projection input 2, its dropout mask 1) plus 5as^2b (softmax output
    2, its dropout mask 1, the dropped-out scores 2); the MLP 19sbh (input 2, GeLU input 8,
    second linear's input 8, dropout mask 1); the two LayerNorms' inputs 4sbh. Under tensor
    parallelism everything but the 10sbh at the LayerNorms and dropouts (LN inputs 4, QKV and
    MLP inputs 2 + 2, two masks 1 + 1) is split t ways; sequence parallelism splits those 10sbh
    too. Selective recompute drops the 5as^2b attention core.
    Full recompute keeps 2sbh per layer (Korthikanti's section 5: checkpoint each layer's input).
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r}; expected one of {RECOMPUTE}")
    if tp < 1 or min(seq, batch, hidden, heads) < 1:
        raise ValueError(
            f"need positive sizes and tp >= 1, got s={seq} b={batch} h={hidden} a={heads} tp={tp}"
        )
    s, b, h, a, t = seq, batch, hidden, heads, tp
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    core = 0.0 if recompute == "selective" else 5 * a * s / (h * t)
    if sp or t == 1:
        return sbh * (34 / t + core)
    return sbh * (10 + 24 / t + core)


def transformer_activation_bytes(
    seq: int, batch: int, hidden: int, heads: int, layers: int = 1
) -> float:
    """Korthikanti et al. 2022: ``s*b*h*(34 + 5*a*s/h)`` bytes per layer (16-bit, no parallelism).

    34 sbh: the layer's 16-bit inputs/outputs of LayerNorms, QKV, projections, GeLU and
    MLP (with 1-byte dropout masks); 5as^2b: the softmax input, output and dropout mask.
    The general form (tensor/sequence parallelism, recompute) is :func:`activation_bytes_per_layer`.
    """
    return layers * activation_bytes_per_layer(seq, batch, hidden, heads)


def communication_bytes(stage: str, psi: float, elem_bytes: int = 2) -> float:
    """Bytes each rank sends per step of ONE micro-batch (ZeRO section 7), counting a ring's
    Psi-sized share. With m micro-batches accumulated, ZeRO-2 reduce-scatters every
    micro-batch and ZeRO-3 also gathers the parameters twice per micro-batch:
    :func:`labkit.planner.space.wire_bytes` counts that (the one convention, per micro-batch).

    A ring all-reduce of Psi elements is a reduce-scatter plus an all-gather, each sending
    (N-1)/N * Psi ~ Psi per rank: 2Psi for DDP. ZeRO-1/2 replace it by exactly those two
    halves (reduce-scatter the gradients, all-gather the updated parameters): still 2Psi.
    ZeRO-3 all-gathers the parameters twice (forward and backward) and reduce-scatters the
    gradients once: 3Psi, 1.5x DDP.
    """
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
    return (3 if stage == "zero3" else 2) * psi * elem_bytes


def paper_round(x: float) -> float:
    """The rounding of ZeRO's Table 1: 1 decimal from 10 GB up, else 2; halves round up."""
    places = Decimal("0.1") if x >= 10 else Decimal("0.01")
    return float(Decimal(repr(x)).quantize(places, rounding=ROUND_HALF_UP))


def zero_table1(
    psi: float = 7.5e9, k: int = 12, dp: tuple[int, ...] = (1, 4, 16, 64, 256, 1024)
) -> dict[int, tuple[float, ...]]:
    """Rows of ZeRO Table 1: ``{N: (baseline, P_os, P_os+g, P_os+g+p)}`` in GB (1e9 bytes)."""
    prec = Precision(2, 2, k)
    return {
        n: tuple(paper_round(model_states(s, psi, n, prec).total / 1e9) for s in STAGES) for n in dp
    }


def activation_bytes_per_layer_sized(
    seq: int,
    batch: int,
    hidden: int,
    heads: int,
    *,
    tp: int = 1,
    sp: bool = False,
    act_bytes: int = 2,
    mask_bytes: int = 1,
) -> float:
    """:func:`activation_bytes_per_layer` (no recompute) with the element sizes as parameters.

    Korthikanti's Table 2 assumes 16-bit activations and 1-byte dropout masks. In elements of
    sbh per layer: 16 activations (LayerNorm inputs 2, QKV input 1, Q K V 3, projection input
    1, MLP input 1, GeLU input 4, second linear input 4) and 2 masks; of those, the LayerNorm,
    QKV and MLP inputs (4) and both masks stay whole under tensor parallelism unless SP splits
    them. The attention core keeps 2 activations and 1 mask per element of (b, a, s, s)::

        replicated R = 4 act + 2 mask,  split S = 12 act,  core C = (2 act + mask) a s / h
        bytes = sbh (R + S/t + C/t),  with SP: sbh ((R + S)/t + C/t)

    act_bytes=2, mask_bytes=1 gives the paper's 10 + 24/t, 34/t and 5as/(ht); labkit's fp32
    CPU runs (act_bytes=4) give 18 + 48/t, 66/t and 9as/(ht).
    """
    if tp < 1 or min(seq, batch, hidden, heads, act_bytes, mask_bytes) < 1:
        raise ValueError(
            f"need positive sizes and tp >= 1, got s={seq} b={batch} h={hidden} a={heads} tp={tp}"
        )
    s, b, h, a, t = seq, batch, hidden, heads, tp
    replicated, split = 4 * act_bytes + 2 * mask_bytes, 12 * act_bytes
    core = (2 * act_bytes + mask_bytes) * a * s / h
    if sp:
        return s * b * h * ((replicated + split) / t + core / t)
    return s * b * h * (replicated + split / t + core / t)
