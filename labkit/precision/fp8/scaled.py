"""A scaled FP8 tensor and the matmul of two of them: what every recipe shares.

An FP8 tensor is a pair (data, scale) with ``t ~ data * scale``: ``data`` in float8, ``scale``
fp32, one per **block** of ``t``. The four recipes differ only in the block and in where the
scale comes from:

    recipe        block of a (rows, cols) operand          scale from
    tensorwise    the whole tensor                         amax(t) now
    delayed       the whole tensor                         max of an amax history (TE)
    rowwise       one row along the contraction dim        amax of that row now
    tiles         1x128 (activations), 128x128 (weights)   amax of the tile now (DeepSeek-V3)

``scale = amax / fmt_max`` maps the block's largest magnitude onto the format's largest value,
so nothing overflows and the smallest values sit as far above the underflow as the format
allows. ``scale`` is the *dequantisation* factor, as ``torch._scaled_mm`` takes it
(``out = (a * scale_a) @ (b * scale_b)``).

Two matmul paths, one answer: :func:`matmul` with ``kernel="emulated"`` dequantises both and
multiplies in fp32 (the reference); ``kernel="scaled_mm"`` calls ``torch._scaled_mm``, which on
torch 2.13's CPU accepts tensorwise and rowwise scales only ("Invalid scaling configuration"
for 1x128/128x128 blocks). Tiles therefore run as DeepSeek-V3 describes its kernel (section
3.3.2, "increasing accumulation precision"): one scaled GEMM per 128-wide slice of the
contraction dimension, each slice's partial product promoted to an fp32 accumulator; within
a slice the scales are per row of A and per column of B, i.e. rowwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["E4M3", "E5M2", "Scaled", "block_amax", "expand", "matmul", "quantize", "to_fp8"]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
KERNELS = ("emulated", "scaled_mm")


@dataclass(frozen=True)
class Scaled:
    """``data`` (R, C) float8, ``scale`` (ceil(R/b0), ceil(C/b1)) fp32, ``block`` (b0, b1):
    element (i, j) means ``data[i, j] * scale[i // b0, j // b1]``."""

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        """(R, C) fp32."""
        return self.data.float() * expand(self.scale, self.block, self.data.shape)

    def t(self) -> Scaled:
        """The transpose: data, scales and block all transposed (free: no rounding)."""
        b0, b1 = self.block
        return Scaled(self.data.t(), self.scale.t(), (b1, b0))

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * 4


def expand(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """Per-block ``scale`` (R/b0, C/b1) -> broadcastable to (R, C) (partial edge blocks cut)."""
    R, C = shape
    full = scale
    # A dim with one block (or blocks of 1) broadcasts as is; only real tiles are repeated.
    if scale.shape[0] > 1 and block[0] > 1:
        full = full.repeat_interleave(block[0], dim=0)[:R]
    if scale.shape[1] > 1 and block[1] > 1:
        full = full.repeat_interleave(block[1], dim=1)[:, :C]
    return full


def block_amax(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max |t| over each (b0, b1) block of a 2-D ``t``: (ceil(R/b0), ceil(C/b1)) fp32."""
    R, C = t.shape
    b0, b1 = min(block[0], R), min(block[1], C)
    pr, pc = -R % b0, -C % b1
    a = torch.nn.functional.pad(t.detach().float().abs(), (0, pc, 0, pr))  # zeros never win
    Rp, Cp = R + pr, C + pc
    # (Rp, Cp) -> (Rp/b0, b0, Cp/b1, b1), max over each block's two inner dims
    return a.view(Rp // b0, b0, Cp // b1, b1).amax(dim=(1, 3))


def to_fp8(t: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
           ) -> torch.Tensor:  # fmt: skip
    """``t / scale`` clamped to the format's max, then cast (round to nearest even). The clamp
    is the recipe's saturation: without it e5m2 overflows to inf (see formats.py)."""
    fmax = torch.finfo(dtype).max
    x = t.float() / expand(scale, block, t.shape)
    return x.clamp(-fmax, fmax).to(dtype)


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """``amax / fmt_max * 2^margin``; an all-zero block keeps scale 1 (nothing to fit)."""
    fmax = torch.finfo(dtype).max
    scale = amax.float() / fmax * 2.0**margin
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def quantize(t: torch.Tensor, dtype: torch.dtype, block: tuple[int, int]) -> Scaled:
    """Dynamic scaling of a 2-D ``t``: each block's scale from its own current amax."""
    scale = scale_from_amax(block_amax(t, block), dtype)
    return Scaled(to_fp8(t, scale, block, dtype), scale, block)


def matmul(a: Scaled, b: Scaled, kernel: str = "emulated") -> torch.Tensor:
    """(M, K) @ (K, N) -> (M, N) fp32. ``emulated``: dequantise, fp32 matmul (the reference).
    ``scaled_mm``: torch._scaled_mm, per 128-slice of K for block scales (module docstring)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}; expected one of {KERNELS}")
    (M, K), (K2, N) = a.data.shape, b.data.shape
    if K != K2:
        raise ValueError(f"inner dimensions differ: a is ({M}, {K}), b is ({K2}, {N})")
    if kernel == "emulated":
        return a.dequantize() @ b.dequantize()
    if a.block == (M, K) and b.block == (K, N):  # tensorwise: one scalar scale each
        return _smm(a.data, b.data, a.scale.reshape(()), b.scale.reshape(()))
    if a.block == (1, K) and b.block == (K, 1):  # rowwise: (M, 1) and (1, N)
        return _smm(a.data, b.data, a.scale.reshape(M, 1), b.scale.reshape(1, N))
    if a.block[1] != b.block[0]:
        raise ValueError(f"blocks {a.block} and {b.block} split K differently")
    step = a.block[1]
    out = torch.zeros(M, N)  # the fp32 accumulator the slices are promoted into
    for j, k0 in enumerate(range(0, K, step)):
        k1 = min(k0 + step, K)
        # slice j: a's scales are per row (M, 1), b's per column (1, N), expanded over blocks
        sa = expand(a.scale[:, j : j + 1], (a.block[0], 1), torch.Size((M, 1))).expand(M, 1)
        sb = expand(b.scale[j : j + 1, :], (1, b.block[1]), torch.Size((1, N))).expand(1, N)
        out += _smm(a.data[:, k0:k1], b.data[k0:k1, :], sa.contiguous(), sb.contiguous())
    return out


def _smm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    # _scaled_mm wants A row-major and B column-major (cuBLASLt's layout; the CPU kernel
    # accepts either, a GPU does not), and fp32 output so no bf16 rounding is added here.
    b = b.t().contiguous().t()
    return torch._scaled_mm(a.contiguous(), b, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
