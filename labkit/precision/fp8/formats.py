"""The 8-bit floating-point formats next to bf16 and fp16, derived from their bits.

A binary float with ``e`` exponent bits (bias ``2^(e-1) - 1``) and ``m`` mantissa bits holds

    normal      (-1)^s * 2^(E - bias) * (1 + M / 2^m)      E = 1 .. E_max
    subnormal   (-1)^s * 2^(1 - bias) * (M / 2^m)          E = 0 (gradual underflow)

so its smallest normal is ``2^(1-bias)``, its smallest subnormal ``2^(1-bias-m)`` and its
relative step (machine epsilon) ``2^-m``. The two FP8 formats of Micikevicius et al. 2022
("FP8 Formats for Deep Learning", Table 1) trade those bits differently:

* **E4M3** (``float8_e4m3fn``, bias 7): no infinities, and only S.1111.111 is NaN, so the top
  exponent carries values: max = 2^8 * 1.75 = **448**; min normal 2^-6, min subnormal 2^-9.
  Three mantissa bits: a rounding step of 2^-3 = 12.5% of a power of two. Forward tensors.
* **E5M2** (``float8_e5m2``, bias 15): IEEE-like, the top exponent is inf/NaN, so
  max = 2^15 * 1.75 = **57,344**; min normal 2^-14, min subnormal 2^-16. Two mantissa bits
  (25% steps) for 2^32 of range: gradients, whose magnitudes spread widest.

bf16 (8 exponent bits, fp32's range) and fp16 (5, max 65,504) are the 16-bit reference points.
Casting rounds to nearest, ties to even. What torch 2.13's CPU cast does past the top is a
measured fact (:func:`overflow_behaviour`): e4m3fn saturates to 448 (even +inf; NaN stays NaN),
e5m2 rounds to inf from 61,440 (halfway to the next power of two) up. A recipe must not rely
on either: it clamps to the format's max before casting (:mod:`labkit.precision.fp8.scaled`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "FORMATS",
    "FloatFormat",
    "bits_of",
    "cast_counts",
    "format_table",
    "overflow_behaviour",
    "representable",
    "round_trip",
]


@dataclass(frozen=True)
class FloatFormat:
    """A binary float format: ``exp_bits`` exponent bits, ``man_bits`` mantissa bits.
    ``ieee_top``: the all-ones exponent is inf/NaN (IEEE); False for E4M3 (only S.1111.111 is
    NaN, so the top exponent carries numbers)."""

    name: str
    exp_bits: int
    man_bits: int
    ieee_top: bool
    dtype: torch.dtype

    @property
    def bias(self) -> int:
        return 2 ** (self.exp_bits - 1) - 1

    @property
    def max(self) -> float:
        if self.ieee_top:  # the largest exponent below all-ones, full mantissa
            return 2.0 ** (2**self.exp_bits - 2 - self.bias) * (2 - 2.0**-self.man_bits)
        # all-ones exponent, mantissa all-ones minus one (all-ones is NaN)
        return 2.0 ** (2**self.exp_bits - 1 - self.bias) * (2 - 2.0 ** (1 - self.man_bits))

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.man_bits)

    @property
    def eps(self) -> float:
        """Relative spacing just above 1.0: a cast's rounding error is at most eps / 2."""
        return 2.0**-self.man_bits

    @property
    def dynamic_range_bits(self) -> float:
        """log2(max / min_subnormal): the powers of two the format spans, subnormals included."""
        return math.log2(self.max / self.min_subnormal)


FORMATS: dict[str, FloatFormat] = {
    "e4m3": FloatFormat("e4m3", 4, 3, False, torch.float8_e4m3fn),
    "e5m2": FloatFormat("e5m2", 5, 2, True, torch.float8_e5m2),
    "fp16": FloatFormat("fp16", 5, 10, True, torch.float16),
    "bf16": FloatFormat("bf16", 8, 7, True, torch.bfloat16),
}


def format_table() -> list[dict[str, object]]:
    """One row per format: the derived limits, each checked against ``torch.finfo`` (a
    mismatch raises: the bit arithmetic above and torch must agree)."""
    rows = []
    for f in FORMATS.values():
        fi = torch.finfo(f.dtype)
        derived = (f.max, f.min_normal, f.eps)
        if derived != (fi.max, fi.smallest_normal, fi.eps):
            raise AssertionError(f"{f.name}: derived {derived} but torch.finfo says "
                                 f"{(fi.max, fi.smallest_normal, fi.eps)}")  # fmt: skip
        rows.append({
            "format": f.name, "bits": f"1+{f.exp_bits}+{f.man_bits}", "bias": f.bias,
            "max": f.max, "min normal": f.min_normal, "min subnormal": f.min_subnormal,
            "eps": f.eps, "range (powers of 2)": round(f.dynamic_range_bits, 1),
        })  # fmt: skip
    return rows


def representable(name: str) -> torch.Tensor:
    """Every finite non-negative value of an 8-bit format, ascending (decoded from all 128
    positive bit patterns by torch's own view; NaN and inf dropped)."""
    f = FORMATS[name]
    if f.dtype.itemsize != 1:
        raise ValueError(f"{name} is not an 8-bit format; expected one of ['e4m3', 'e5m2']")
    codes = torch.arange(0, 128, dtype=torch.uint8)  # sign bit 0
    values = codes.view(f.dtype).float()
    return values[torch.isfinite(values)].unique()  # sorted


def round_trip(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x`` cast to the format and back to fp32: what a tensor looks like after the cast."""
    return x.float().to(FORMATS[name].dtype).float()


def bits_of(value: float, name: str) -> str:
    """The cast's bit pattern as ``"s eeee mmm"`` (8-bit formats): ``bits_of(448, "e4m3")``
    is ``"0 1111 110"``."""
    f = FORMATS[name]
    if f.dtype.itemsize != 1:
        raise ValueError(f"{name} is not an 8-bit format; expected one of ['e4m3', 'e5m2']")
    code = int(torch.tensor([value]).to(f.dtype).view(torch.uint8).item())
    b = f"{code:08b}"
    return f"{b[0]} {b[1 : 1 + f.exp_bits]} {b[1 + f.exp_bits :]}"


def cast_counts(x: torch.Tensor, name: str) -> dict[str, float]:
    """Fractions of ``x``'s non-zero elements that the cast would lose: above max
    (``overflow``), flushed to zero (``underflow``), or landing among the subnormals, where
    relative precision decays (``subnormal``)."""
    f = FORMATS[name]
    a = x.detach().float().abs()
    nonzero = a > 0
    n = max(int(nonzero.sum()), 1)
    back = round_trip(x, name).abs()
    return {
        "overflow": float((a > f.max).sum()) / n,
        "underflow": float((nonzero & (back == 0)).sum()) / n,
        "subnormal": float((nonzero & (back > 0) & (back < f.min_normal)).sum()) / n,
    }


def overflow_behaviour() -> dict[str, list[float]]:
    """What torch's cast does just past each 8-bit format's top, measured here:
    inputs ``[max, 1.04 max, 1.1 max, 1e6, inf]`` per format, cast and read back."""
    out = {}
    for name in ("e4m3", "e5m2"):
        m = FORMATS[name].max
        x = torch.tensor([m, 1.04 * m, 1.1 * m, 1e6, float("inf")])
        out[name] = round_trip(x, name).tolist()
    return out
