"""What FP8 training changes in per-GPU memory: the linears' saved inputs and ZeRO-3's
gathered weights, each in one byte instead of two.

**Activations.** Of Korthikanti et al.'s 34 sbh bytes a layer keeps (Table 2, 16-bit), four
tensors are the inputs of the four linears, which an FP8 linear saves in e4m3 for its weight
gradient (Transformer Engine and :mod:`labkit.precision.fp8.linear` keep the cast copy):

    QKV input 2 sbh (replicated under tp, split by sp)     out-proj input 2 sbh / t
    fc input  2 sbh (replicated under tp, split by sp)     fc2 input     8 sbh / t

In one byte they keep half: ``sbh (2 + 5/t)`` bytes saved per layer under tensor
parallelism, ``7 sbh / t`` with sequence parallelism (everything split). Everything else
(LayerNorm and GeLU inputs, softmax, dropout masks) stays 16-bit. Full recompute keeps
only each layer's input (the block's, not a linear's): nothing to save. Scales are one fp32
per tensor (or per 128 elements for tiles: 1/32 of a byte per element, left out).

**Weights.** FSDP2 with torchao's ``enable_fsdp_float8_all_gather`` (and DeepSpeed-style
ZeRO-3 with FP8 weights) casts each rank's shard to FP8 *before* the all-gather, so the
gathered layer, ZeRO-3's transient workspace, and its all-gather bytes halve:
``1 * P_layer`` instead of ``2 * P_layer``. The fp32 master weights, gradients and Adam
moments are unchanged (FP8 is a compute format, not a storage format for the optimizer).

**What FP8 adds.** Each linear's forward casts its weight and keeps that FP8 copy for the
input gradient (:mod:`labkit.precision.fp8.linear` does; so does torchao unless told to
recompute it, and Transformer Engine caches it for the step): one byte per linear weight
element, from the forward to the backward of every layer a rank holds. The four linears of
a GPT layer have ``12 h^2`` weights, ``12 h^2 / t`` on a tp rank.
"""

from __future__ import annotations

__all__ = ["fp8_activation_saving", "fp8_gather_bytes", "fp8_weight_copy_bytes"]


def fp8_activation_saving(seq: int, batch: int, hidden: int, *, tp: int = 1, sp: bool = False,
                          recompute: str = "none") -> float:  # fmt: skip
    """Bytes one layer's saved activations shrink by on one tp rank when its four linears
    keep their inputs in FP8 (module docstring)."""
    if min(seq, batch, hidden, tp) < 1:
        raise ValueError(f"need positive sizes, got seq={seq} batch={batch} hidden={hidden} "
                         f"tp={tp}")  # fmt: skip
    if recompute == "full":
        return 0.0
    sbh = seq * batch * hidden
    bf16 = (14.0 / tp if sp else 4.0 + 10.0 / tp) * sbh  # the four inputs, 16-bit
    return bf16 / 2  # one byte instead of two


def fp8_gather_bytes(layer_params: float, fp8: bool) -> float:
    """Bytes of one gathered layer's weights on a ZeRO-3/FSDP rank: 2 a parameter in bf16,
    1 when the shard is cast to FP8 before the all-gather."""
    if layer_params < 0:
        raise ValueError(f"layer_params must be >= 0, got {layer_params}")
    return layer_params * (1 if fp8 else 2)


def fp8_weight_copy_bytes(hidden: int, layers: int, tp: int = 1) -> float:
    """Bytes of the FP8 weight copies ``layers`` GPT layers keep from forward to backward on
    one of ``tp`` ranks: one byte per element of the four linears' ``12 h^2 / t`` weights."""
    if min(hidden, layers, tp) < 1:
        raise ValueError(f"need positive sizes, got hidden={hidden} layers={layers} tp={tp}")
    return 12.0 * hidden * hidden / tp * layers
