"""What a scaling recipe is: a block shape per GEMM operand and a rule for the block's scale.

A GEMM ``(M, K) @ (K, N)`` contracts K. Every recipe answers, for each operand (its shape, the
dim it contracts, and whether it is an activation, a weight or a gradient), two questions:

* :meth:`Recipe.block`: which elements share one scale;
* :meth:`Recipe.scale`: the scale of each block from its amax (the dynamic rule is
  ``amax / fmt_max``; the delayed recipe overrides it with a history).

Backward reuses the forward's FP8 tensors where their blocks still fit the new contraction
(:meth:`Recipe.reuse`): a tensor-scaled operand is transposed for free, a rowwise or 1x128 one
is not, and must be requantised along the other axis (a second rounding, as DeepSeek-V3
notes for its transposed activations).

Under tensor parallelism an operand may be split along a dim its block spans (a tensorwise
scale covers the whole weight, of which each rank holds 1/t): then each rank's amax is
partial and the ranks all-reduce it with MAX so all use the one scale the unsplit tensor
would (``reduce``; Transformer Engine reduces amaxes over the tp group the same way). Tiles
never span a shard (the layer checks the split is a multiple of 128): no communication.

:class:`Unscaled` (scale 1, saturating cast) is the negative control.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from labkit.precision.fp8.scaled import Scaled, block_amax, scale_from_amax, to_fp8

__all__ = ["KINDS", "Recipe", "Reduce", "Unscaled"]

KINDS = ("activation", "weight", "grad")
Reduce = Callable[[torch.Tensor], torch.Tensor]  # all-reduce MAX of an amax tensor


class Recipe:
    """Base: dynamic tensorwise blocks and scales; subclasses change one or the other."""

    name = "tensorwise"

    def spans(self, contract_dim: int, kind: str) -> tuple[bool, bool]:
        """Per dim of the 2-D operand: does one block span the whole dim?"""
        return (True, True)

    def block(self, shape: torch.Size, contract_dim: int, kind: str) -> tuple[int, int]:
        s = self.spans(contract_dim, kind)
        return (shape[0] if s[0] else 1, shape[1] if s[1] else 1)

    def scale(self, amax: torch.Tensor, dtype: torch.dtype, role: str | None) -> torch.Tensor:
        """Dequantisation scale of each block; ``role`` names a tensor with state (delayed)."""
        return scale_from_amax(amax, dtype)

    def fresh(self) -> Recipe:
        """An instance for one more layer (stateless recipes share themselves)."""
        return self

    def quantize(
        self,
        t: torch.Tensor,
        dtype: torch.dtype,
        contract_dim: int,
        kind: str,
        role: str | None = None,
        shard_dim: int | None = None,
        reduce: Reduce | None = None,
    ) -> Scaled:
        """``t`` (2-D) as FP8 for a GEMM contracting ``contract_dim``; ``shard_dim``: the dim
        split across ranks (None: replicated), whose spanning blocks' amax is ``reduce``d."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}; expected one of {KINDS}")
        block = self.block(t.shape, contract_dim, kind)
        amax = block_amax(t, block)
        split = shard_dim is not None and self.spans(contract_dim, kind)[shard_dim]
        if reduce is not None and split:  # each rank holds part of the block: MAX over them
            amax = reduce(amax)
        scale = self.scale(amax, dtype, role)
        return Scaled(to_fp8(t, scale, block, dtype), scale, block)

    def reuse(
        self,
        s: Scaled,
        contract_dim: int,
        kind: str,
        source: torch.Tensor | None = None,
        shard_dim: int | None = None,
        reduce: Reduce | None = None,
    ) -> Scaled:
        """``s`` for a GEMM contracting ``contract_dim``: as is when its blocks fit, else
        requantised from ``source`` (the high-precision tensor) or from ``s`` itself."""
        if s.block == self.block(s.data.shape, contract_dim, kind):
            return s
        t = source if source is not None else s.dequantize()
        return self.quantize(t, s.data.dtype, contract_dim, kind, None, shard_dim, reduce)


class Unscaled(Recipe):
    """The negative control: cast with scale 1 (clamped at the format's max). Gradients of a
    mean loss sit near e5m2's underflow (2^-16), so most of them flush to zero."""

    name = "unscaled"

    def scale(self, amax: torch.Tensor, dtype: torch.dtype, role: str | None) -> torch.Tensor:
        return torch.ones_like(amax, dtype=torch.float32)
