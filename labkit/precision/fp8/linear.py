"""The FP8 linear: three GEMMs per layer, e4m3 forward operands, e5m2 gradients.

For ``y = x W^T + b`` with x (M, K) tokens by input features and W (N, K):

    forward   y  = x  @ W^T     (M, K) @ (K, N)   x, W in e4m3        contracts K
    dgrad     dx = dy @ W       (M, N) @ (N, K)   dy in e5m2, W e4m3   contracts N
    wgrad     dW = dy^T @ x     (N, M) @ (M, K)   dy in e5m2, x e4m3   contracts M

(Micikevicius et al. 2022 and Transformer Engine's "HYBRID" format: e4m3's precision where
values are bounded, e5m2's range for gradients). Every GEMM accumulates and returns fp32;
the bias is added in high precision. What is saved for backward is the FP8 x and W (one byte
per element plus scales): the activation memory FP8 saves. A recipe whose x blocks do not fit
wgrad's contraction requantises the saved FP8 x (a second rounding, DeepSeek-V3's choice);
the weight is requantised from the Parameter itself. Each product is computed by
:func:`labkit.precision.fp8.scaled.matmul` (``kernel``: "emulated" or "scaled_mm").

The model never knows: :func:`fp8_linears` swaps chosen ``nn.Linear`` modules for
:class:`Fp8Linear`, which keeps the same Parameter objects (the optimizer and the weights are
untouched). Autocast is switched off inside the Function, so under bf16 autocast the FP8
GEMMs are what the recipe says and the rest of the model runs in bf16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from labkit.precision.fp8.delayed import Delayed
from labkit.precision.fp8.formats import FORMATS
from labkit.precision.fp8.recipe import Recipe, Reduce, Unscaled
from labkit.precision.fp8.rowwise import Rowwise
from labkit.precision.fp8.scaled import E4M3, KERNELS, matmul
from labkit.precision.fp8.tensorwise import Tensorwise
from labkit.precision.fp8.tiles import Tiles

__all__ = ["RECIPES", "Fp8Config", "Fp8Linear", "Shards", "fp8_linear", "fp8_linears",
           "make_recipe"]  # fmt: skip

RECIPES = ("tensorwise", "delayed", "rowwise", "tiles", "unscaled")


@dataclass(frozen=True)
class Fp8Config:
    """``recipe``: one of RECIPES; ``kernel``: "emulated" or "scaled_mm"; ``grad_format``:
    what gradients are cast to ("e5m2"; "e4m3" is the control); ``history_len``/``margin``:
    the delayed recipe's; ``tile``: the tiles recipe's block edge."""

    recipe: str = "tensorwise"
    kernel: str = "emulated"
    grad_format: str = "e5m2"
    history_len: int = 16
    margin: int = 0
    tile: int = 128

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"recipe={self.recipe!r}; expected one of {RECIPES}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel={self.kernel!r}; expected one of {KERNELS}")
        if self.grad_format not in ("e4m3", "e5m2"):
            raise ValueError(f"grad_format={self.grad_format!r}; expected 'e4m3' or 'e5m2'")


def make_recipe(cfg: Fp8Config) -> Recipe:
    """A fresh recipe instance (its own delayed-scaling histories)."""
    if cfg.recipe == "delayed":
        return Delayed(cfg.history_len, cfg.margin)
    if cfg.recipe == "tiles":
        return Tiles(cfg.tile)
    return {"tensorwise": Tensorwise, "rowwise": Rowwise, "unscaled": Unscaled}[cfg.recipe]()


@dataclass(frozen=True)
class Shards:
    """Which dim of x (M, K), W (N, K) and dy (M, N) is split across the tp group (None:
    replicated), and the amax all-reduce (MAX) for blocks spanning a split dim."""

    x: int | None = None
    w: int | None = None
    dy: int | None = None
    reduce: Reduce | None = None


class _Fp8Matmul(torch.autograd.Function):
    """x (M, K), W (N, K) -> x W^T (M, N) through FP8; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, recipe: Recipe, cfg: Fp8Config,
                sh: Shards) -> torch.Tensor:  # fmt: skip
        with torch.autocast(x.device.type, enabled=False):
            qx = recipe.quantize(x, E4M3, 1, "activation", "input", sh.x, sh.reduce)
            qw = recipe.quantize(w, E4M3, 1, "weight", "weight", sh.w, sh.reduce)
            y = matmul(qx, qw.t(), cfg.kernel)  # (M, K) @ (K, N)
        ctx.save_for_backward(w)  # a Parameter: requantising it along N costs no memory
        ctx.qx, ctx.qw, ctx.recipe, ctx.cfg, ctx.sh = qx, qw, recipe, cfg, sh
        ctx.dtypes = (x.dtype, w.dtype)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        recipe, cfg, sh = ctx.recipe, ctx.cfg, ctx.sh
        gdt = FORMATS[cfg.grad_format].dtype
        flip = {None: None, 0: 1, 1: 0}
        with torch.autocast(dy.device.type, enabled=False):
            dy = dy.float()
            qdy = recipe.quantize(dy, gdt, 1, "grad", "grad_output", sh.dy, sh.reduce)
            (w,) = ctx.saved_tensors
            qw = recipe.reuse(ctx.qw, 0, "weight", w, sh.w, sh.reduce)  # (N, K) along N
            dx = matmul(qdy, qw, cfg.kernel)  # (M, N) @ (N, K)
            qdy_t = recipe.reuse(qdy.t(), 1, "grad", dy.t(), flip[sh.dy], sh.reduce)  # (N, M)
            qx = recipe.reuse(ctx.qx, 0, "activation", shard_dim=sh.x, reduce=sh.reduce)
            dw = matmul(qdy_t, qx, cfg.kernel)  # (N, M) @ (M, K)
        ctx.qx = ctx.qw = None
        return dx.to(ctx.dtypes[0]), dw.to(ctx.dtypes[1]), None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               recipe: Recipe, cfg: Fp8Config, shards: Shards | None = None
               ) -> torch.Tensor:  # fmt: skip
    """``F.linear`` through FP8: x (..., K), weight (N, K) -> (..., N)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # (..., K) -> (M, K)
    y = _Fp8Matmul.apply(x2, weight, recipe, cfg, shards or Shards())
    y = y.reshape(*lead, weight.shape[0])  # (M, N) -> (..., N)
    return y if bias is None else y + bias.to(y.dtype)


class Fp8Linear(nn.Module):
    """An ``nn.Linear`` whose three GEMMs run in FP8; shares ``linear``'s Parameters."""

    def __init__(self, linear: nn.Linear, cfg: Fp8Config) -> None:
        super().__init__()
        self.cfg, self.recipe = cfg, make_recipe(cfg)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.recipe, self.cfg)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, recipe={self.cfg.recipe}"


def fp8_linears(model: nn.Module, cfg: Fp8Config,
                where: Callable[[str], bool] = lambda name: True) -> list[str]:  # fmt: skip
    """Replace, in place, every ``nn.Linear`` of ``model`` whose qualified name passes
    ``where`` by an :class:`Fp8Linear`; returns the names replaced. Keep the first and last
    layers (embedding, head) out of it, as DeepSeek-V3 and TE users do: ``where=lambda n:
    n.startswith("blocks.")``."""
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear and where(n)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Fp8Linear(getattr(parent, child), cfg))
    return names
