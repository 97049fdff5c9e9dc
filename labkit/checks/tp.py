"""Check for exercise 06: the learner's ColumnParallelLinear and RowParallelLinear, with f and g.

Contract checked (both classes)::

    layer = ColumnParallelLinear(full: nn.Linear, group=None)   # keeps rank r's shard
    layer = RowParallelLinear(full: nn.Linear, group=None)
    layer.weight, layer.bias                                     # the shards (bias may be None)

* Column: weight = rows [r out/t, (r+1) out/t) of ``full.weight`` (and the same rows of the
  bias); ``layer(x)`` takes the replicated x and returns this rank's out/t output features;
  dL/dx after backward is the *full* input gradient on every rank (f all-reduces it).
* Row: weight = columns [r in/t, (r+1) in/t); the bias is the whole bias; ``layer(x_r)``
  takes this rank's in/t input features and returns the full output on every rank (g sums
  the partial products, then the bias is added once).

The harness runs on 2 and then 3 ranks: each layer alone and the two chained into an MLP
(column -> GeLU -> row), with a loss that weighs every output element differently. On every
rank it compares, in this order, the forward output, the input gradient and the weight (and
bias) gradient with the single-process nn.Linear, and reports the first wrong one by name and
rank. An f or g that all-reduces in the wrong direction fails the forward output.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from labkit.checks.core import CheckFailed, compare, launch_check, passed

__all__ = ["check_tp_layers"]

IN, HIDDEN, OUT, BATCH = 6, 12, 5, 4  # HIDDEN divisible by 2 and 3

HINTS = {
    "forward output": "does f return its input unchanged in forward, and does g all-reduce "
    "(sum) the partial products in forward, adding the bias after the sum?",
    "input gradient": "f must all-reduce the input gradient in backward; g must pass it "
    "through unchanged",
    "weight gradient": "is the shard the right slice of the full weight (rows for column, "
    "columns for row parallel)?",
    "bias gradient": "column: this rank's slice of the bias; row: the whole bias, added once",
}


def _full_layers() -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    return nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, OUT)


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, IN, generator=g)
    w_hidden = torch.randn(BATCH, HIDDEN, generator=g)  # loss weights: every element differs
    w_out = torch.randn(BATCH, OUT, generator=g)
    return x, w_hidden, w_out


def _slice(t: Any, dim: int, rank: int, n: int) -> torch.Tensor:
    k = t.shape[dim] // n
    return t.narrow(dim, rank * k, k)


def _grads(layer: Any) -> tuple[Any, Any]:
    bias = getattr(layer, "bias", None)
    return layer.weight.grad, None if bias is None else bias.grad


def _compare_all(case: str, pairs: list[tuple[str, Any, Any]]) -> str | None:
    for what, expected, got in pairs:
        if got is None:
            return f"{case}: {what} is missing (None)"
        problem = compare(expected, got, what=f"{case}: {what}", atol=1e-5, rtol=1e-4)
        if problem:
            return problem + f"\n  hint: {HINTS[what.split(' of ')[0]]}"
    return None


def _run(col_cls: Any, row_cls: Any) -> list[str]:
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    fc, proj = _full_layers()
    x, w_h, w_o = _data()
    problems = []

    # ColumnParallelLinear alone: L = sum_r <y_r, w_r>, so dL/dx = w @ W on every rank.
    x_ref = x.clone().requires_grad_()
    (fc(x_ref) * w_h).sum().backward()
    col = col_cls(fc, None)
    x_c = x.clone().requires_grad_()
    y = col(x_c)
    (y * _slice(w_h, 1, rank, n)).sum().backward()
    wg, bg = _grads(col)
    problems.append(_compare_all("ColumnParallelLinear", [
        ("forward output", _slice(fc(x), 1, rank, n).detach(), y),
        ("input gradient", x_ref.grad, x_c.grad),
        ("weight gradient", _slice(fc.weight.grad, 0, rank, n), wg),
        ("bias gradient", _slice(fc.bias.grad, 0, rank, n), bg),
    ]))  # fmt: skip

    # RowParallelLinear alone: input x_r = this rank's features, output the full product.
    fc.zero_grad()
    h = torch.randn(BATCH, HIDDEN, generator=torch.Generator().manual_seed(2))
    h_ref = h.clone().requires_grad_()
    (proj(h_ref) * w_o).sum().backward()
    row = row_cls(proj, None)
    h_r = _slice(h, 1, rank, n).clone().requires_grad_()
    y = row(h_r)
    (y * w_o).sum().backward()
    wg, bg = _grads(row)
    problems.append(_compare_all("RowParallelLinear", [
        ("forward output", proj(h).detach(), y),
        ("input gradient", _slice(h_ref.grad, 1, rank, n), h_r.grad),
        ("weight gradient", _slice(proj.weight.grad, 1, rank, n), wg),
        ("bias gradient", proj.bias.grad, bg),
    ]))  # fmt: skip

    # The Megatron MLP: column -> GeLU -> row, no communication in between.
    fc.zero_grad()
    proj.zero_grad()
    x_ref = x.clone().requires_grad_()
    (proj(torch.nn.functional.gelu(fc(x_ref))) * w_o).sum().backward()
    col, row = col_cls(fc, None), row_cls(proj, None)
    x_m = x.clone().requires_grad_()
    y = row(torch.nn.functional.gelu(col(x_m)))
    (y * w_o).sum().backward()
    problems.append(_compare_all("MLP (column -> GeLU -> row)", [
        ("forward output", proj(torch.nn.functional.gelu(fc(x))).detach(), y),
        ("input gradient", x_ref.grad, x_m.grad),
        ("weight gradient of the column layer", _slice(fc.weight.grad, 0, rank, n),
         col.weight.grad),
        ("weight gradient of the row layer", _slice(proj.weight.grad, 1, rank, n), row.weight.grad),
    ]))  # fmt: skip
    return [p for p in problems if p]


def check_tp_layers(col_cls: Any, row_cls: Any, world_sizes: tuple[int, ...] = (2, 3)) -> None:
    """Run the learner's layers on each world size; raise :class:`CheckFailed` naming the
    first wrong quantity (forward output, input gradient, weight gradient) and its rank."""
    for n in world_sizes:
        per_rank = launch_check(
            _run, col_cls, row_cls, world_size=n, timeout=120, quiet=True, backend="gloo"
        )
        for rank, problems in enumerate(per_rank):
            if problems:
                raise CheckFailed(f"on {n} ranks, rank {rank}: {problems[0]}")
    passed(
        f"ColumnParallelLinear, RowParallelLinear and the MLP they make match nn.Linear on "
        f"{' and '.join(map(str, world_sizes))} ranks: outputs, input and weight gradients"
    )
