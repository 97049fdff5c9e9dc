"""DeepSeek-V3's fine-grained scaling: 1x128 tiles for activations, 128x128 for weights.

DeepSeek-V3 technical report (2024), section 3.3.2: an activation (tokens, K) gets one scale
per token per 128 channels (a 1x128 tile along K); a weight one per 128x128 block; gradients
are activations (1x128 along their contraction dim). A channel outlier then perturbs 128
values, not a row or a tensor. Since the scales change every 128 steps of K, they no longer
factor out of a whole dot product: the GEMM multiplies one 128-slice of K at a time, scales
that partial product and adds it to an fp32 accumulator (their "promotion to CUDA cores",
which also fixes H800's ~14-bit tensor-core accumulation). :func:`labkit.precision.fp8.
scaled.matmul` does exactly that with one ``torch._scaled_mm`` per slice.

The 128x128 weight block transposes to itself, so the weight's FP8 copy serves dgrad too;
an activation's 1x128 tiles do not (wgrad contracts over tokens: 128x1), and are requantised.
All of them stay inside a tensor-parallel shard whose split is a multiple of 128: no amax
communication (``spans`` is False everywhere).
"""

from __future__ import annotations

import torch

from labkit.precision.fp8.recipe import Recipe

__all__ = ["Tiles"]


class Tiles(Recipe):
    """``tile`` x ``tile`` blocks for weights, 1 x ``tile`` along K for everything else."""

    name = "tiles"

    def __init__(self, tile: int = 128) -> None:
        if tile < 1:
            raise ValueError(f"tile={tile} must be >= 1")
        self.tile = tile

    def spans(self, contract_dim: int, kind: str) -> tuple[bool, bool]:
        return (False, False)

    def block(self, shape: torch.Size, contract_dim: int, kind: str) -> tuple[int, int]:
        if kind == "weight":
            return (self.tile, self.tile)
        return (self.tile, 1) if contract_dim == 0 else (1, self.tile)
