"""Rowwise dynamic scaling: one scale per row of A and per column of B of each GEMM.

For ``(M, K) @ (K, N)`` the scales are (M, 1) for A and (1, N) for B: each scale spans the
contraction dim K, so it factors out of every dot product,

    out[i, j] = scale_a[i] * scale_b[j] * sum_k a8[i, k] b8[k, j],

and the kernel applies it once per output (``torch._scaled_mm`` takes these shapes; it runs
on torch 2.13's CPU). An outlier now costs only its own token (row of the activations) or
output feature (row of the weight), not the whole tensor. The backward contracts other
dims (dgrad over N, wgrad over M), so each GEMM requantises its operands along its own K:
the forward's FP8 copies do not transpose. torchao's "rowwise" recipe is this one.
"""

from __future__ import annotations

from labkit.precision.fp8.recipe import Recipe

__all__ = ["Rowwise"]


class Rowwise(Recipe):
    """A block spans the contraction dim and is one element wide across it."""

    name = "rowwise"

    def spans(self, contract_dim: int, kind: str) -> tuple[bool, bool]:
        return (contract_dim == 0, contract_dim == 1)
