"""Column- and row-parallel FP8 linears on 2 gloo ranks against the single-process FP8 linear.

Each rank builds the same full layer and its FP8 version (the reference), then its shard;
three steps of forward and backward (so the delayed recipe's histories advance) on inputs
of the same seed. The sharded layer's output, dx and gathered dW must equal the reference's
up to fp32 summation order, for every recipe, in both layouts; the tiles recipe with shards
that are whole tiles communicates no amax at all. Negative control: without the amax MAX
all-reduce, each rank scales its part with its own amax, and the tensorwise layers differ
from the reference by e4m3's rounding, far above the tolerance.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.ranks import run_ranks

M, K, N, STEPS = 24, 64, 32, 3
TOL = 2e-5  # relative, max over elements: fp32 sums in another order (seen ~1e-7)


def _case(recipe: str, layout: str, amax_reduce: bool = True) -> float:
    """Largest relative difference, over 3 steps, of y, dx and dW against the reference."""
    import torch.distributed as dist

    from labkit.collectives import Comm
    from labkit.precision.fp8 import Fp8Config, Fp8Linear
    from labkit.precision.fp8.parallel import ColumnParallelFp8Linear, RowParallelFp8Linear

    rank, t = dist.get_rank(), dist.get_world_size()
    cfg = Fp8Config(recipe=recipe, tile=16)
    torch.manual_seed(0)
    full = torch.nn.Linear(K, N)
    ref = Fp8Linear(full, cfg)
    cls = ColumnParallelFp8Linear if layout == "column" else RowParallelFp8Linear
    par = cls(full, Comm(None), cfg, amax_reduce=amax_reduce)
    worst = 0.0
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x = (torch.randn(M, K, generator=g) * (1 + step)).requires_grad_()
        x[0, 0].data.mul_(40.0)  # one loud element: per-rank and global amaxes differ
        dy = torch.randn(M, N, generator=g) * 1e-3
        y_ref = ref(x)
        dx_ref, dw_ref = torch.autograd.grad(y_ref, (x, ref.weight), dy)
        xp = x.detach().clone().requires_grad_()
        n = K // t
        inp = xp if layout == "column" else xp[:, rank * n : (rank + 1) * n]
        y = par(inp)
        if layout == "column":  # this rank's output features
            w = N // t
            y_full = _gather(y, dim=1)
            (dx, dw) = torch.autograd.grad(y, (xp, par.weight), dy[:, rank * w : (rank + 1) * w])
            dw_full = _gather(dw, dim=0)
        else:
            y_full = y
            (dx, dw) = torch.autograd.grad(y, (xp, par.weight), dy)
            dist.all_reduce(dx)  # each rank's dx covers its own input features only
            dw_full = _gather(dw, dim=1)
        for a, b in ((y_full, y_ref), (dx, dx_ref), (dw_full, dw_ref)):
            worst = max(worst, ((a - b).abs().max() / b.abs().max()).item())
    return worst


def _gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=dim)


RECIPES = ("tensorwise", "delayed", "rowwise", "tiles")


def _all() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for recipe in RECIPES:
        for layout in ("column", "row"):
            out[f"{recipe}/{layout}"] = _case(recipe, layout)
    for layout in ("column", "row"):
        out[f"control/{layout}"] = _case("tensorwise", layout, amax_reduce=False)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_all, world_size=2, timeout=240)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("layout", ["column", "row"])
def test_parallel_fp8_linear_matches_the_single_process_one(results, recipe, layout) -> None:
    for rank, r in enumerate(results):
        assert r[f"{recipe}/{layout}"] < TOL, (rank, recipe, layout, r[f"{recipe}/{layout}"])


@pytest.mark.parametrize("layout", ["column", "row"])
def test_without_the_amax_reduce_the_ranks_scale_apart(results, layout) -> None:
    # negative control: local amaxes give other FP8 values (e4m3 steps are 2^-3 apart)
    assert max(r[f"control/{layout}"] for r in results) > 100 * TOL


def test_tiles_that_straddle_ranks_are_refused() -> None:
    from labkit.precision.fp8 import Fp8Config
    from labkit.precision.fp8.parallel import _fp8_setup

    split, tiles, rows = (None, 0, 1), Fp8Config(recipe="tiles", tile=16), Fp8Config("rowwise")
    with pytest.raises(ValueError, match="out_features per rank is 24, not a multiple of tile=16"):
        _fp8_setup(tiles, None, True, 24, "out_features", split)  # type: ignore[arg-type]
    _, shards = _fp8_setup(rows, None, False, 24, "out_features", split)  # type: ignore[arg-type]
    assert (shards.x, shards.w, shards.dy, shards.reduce) == (None, 0, 1, None)  # no tiles: fine
