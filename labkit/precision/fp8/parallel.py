"""Column- and row-parallel FP8 linears: Megatron's layers with the GEMM through FP8.

The communication is labkit's own tensor-parallel mappings, unchanged
(:mod:`labkit.tensor_parallel.mappings`: f / g and their sequence-parallel forms); only the
local matmul becomes :func:`~labkit.precision.fp8.linear.fp8_linear`. What FP8 adds is the
*scales*: a block that spans a split dim sees only this rank's part of it, so its amax is
all-reduced (MAX) over the tp group, and every rank casts with the scale the unsplit layer
would have used. Then each rank's FP8 values are exactly the unsplit layer's, and the
outputs and gradients differ from it only by the order of fp32 sums. Which blocks span a
split (x: (M, K), W: (N, K), dy: (M, N)):

    column-parallel  W split along N (dim 0), dy along N (dim 1), x replicated
    row-parallel     x and W split along K (dim 1), dy replicated

tensorwise/delayed blocks span everything (one MAX per tensor per call; TE reduces amaxes
across the tp group the same way); rowwise spans only its contraction dim; DeepSeek-V3's
tiles span nothing when the split is a multiple of the tile: no communication at all
(checked here, naming the sizes). The amax all-reduce goes through torch.distributed
directly (labkit's Comm sums; these are a few bytes, not counted in its ledger).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from labkit.collectives import Comm
from labkit.precision.fp8.linear import Fp8Config, Shards, fp8_linear, make_recipe
from labkit.precision.fp8.recipe import Recipe
from labkit.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from labkit.tensor_parallel.mappings import (
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    reduce_scatter_to_sp,
)

__all__ = ["ColumnParallelFp8Linear", "RowParallelFp8Linear", "amax_max"]


def amax_max(comm: Comm) -> Shards:
    """The reduce for :class:`Shards`: all-reduce MAX over ``comm``'s group, in place."""

    def reduce(amax: torch.Tensor) -> torch.Tensor:
        amax = amax.contiguous()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=comm.group)
        return amax

    return Shards(reduce=reduce)


def _fp8_setup(cfg: Fp8Config, comm: Comm, amax_reduce: bool, local: int, what: str,
               split: tuple[int | None, int | None, int | None]
               ) -> tuple[Recipe, Shards]:  # fmt: skip
    """The layer's recipe and its Shards (``split``: the split dim of x, W, dy); tiles must
    not straddle two ranks."""
    if cfg.recipe == "tiles" and local % cfg.tile:
        raise ValueError(f"{what} per rank is {local}, not a multiple of tile={cfg.tile}: a "
                         f"tile would straddle two ranks")  # fmt: skip
    reduce = amax_max(comm).reduce if amax_reduce else None
    return make_recipe(cfg), Shards(*split, reduce=reduce)


class ColumnParallelFp8Linear(ColumnParallelLinear):
    """:class:`ColumnParallelLinear` with its GEMMs in FP8. ``amax_reduce=False`` skips the
    MAX all-reduce (the negative control: each rank then scales with its own amax)."""

    def __init__(self, linear: nn.Linear, comm: Comm, cfg: Fp8Config,
                 input_mode: str = "copy", amax_reduce: bool = True) -> None:  # fmt: skip
        super().__init__(linear, comm, input_mode)
        self.cfg = cfg  # W split along N (dim 0), so is dy (dim 1); x replicated
        self.recipe, self.shards = _fp8_setup(cfg, comm, amax_reduce, self.out_features,
                                              "out_features", (None, 0, 1))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_mode == "copy":
            x = copy_to_tp(x, self.comm)
        elif self.input_mode == "gather":
            x = gather_from_sp(x, self.comm)
        return fp8_linear(x, self.weight, self.bias, self.recipe, self.cfg, self.shards)


class RowParallelFp8Linear(RowParallelLinear):
    """:class:`RowParallelLinear` with its GEMMs in FP8; the bias is added after the sum."""

    def __init__(self, linear: nn.Linear, comm: Comm, cfg: Fp8Config,
                 output_mode: str = "reduce", amax_reduce: bool = True) -> None:  # fmt: skip
        super().__init__(linear, comm, output_mode)
        self.cfg = cfg  # x and W split along K (dim 1); dy replicated
        self.recipe, self.shards = _fp8_setup(cfg, comm, amax_reduce, self.in_features,
                                              "in_features", (1, 1, None))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = fp8_linear(x, self.weight, None, self.recipe, self.cfg, self.shards)
        if self.output_mode == "reduce":
            y = reduce_from_tp(partial, self.comm)
        else:
            y = reduce_scatter_to_sp(partial, self.comm)
        return y if self.bias is None else y + self.bias
