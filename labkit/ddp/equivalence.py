"""The DDP proof: :class:`~labkit.reference.AwkwardNet` trained on ranks and in one process.

The spec every DDP variant must meet: trained ``steps`` optimizer steps on ``world_size``
ranks, each rank seeing ``1 / world_size`` of every micro-batch, the parameters after
*every* step equal those of single-process training on the full micro-batches (up to
float summation order), and are bit-identical across ranks.

:class:`AwkwardNet` (in :mod:`labkit.reference`, the one harness every proof shares) packs the
cases that break naive implementations: a frozen weight, a tied weight used twice, and a layer
``extra`` that in some steps no rank uses (its ``grad`` must stay None: SGD's momentum and
weight decay would move it otherwise) and in others only rank 0 does.

Ranks build their model from *different* seeds, so only the broadcast from rank 0 makes them
agree. The optimizer is SGD with momentum and weight decay for the reason above.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from labkit.reference import AwkwardNet, Snapshot, first_divergence, snapshot
from labkit.reference import train_reference as _reference_loop

__all__ = [
    "AwkwardNet",
    "Snapshot",
    "first_divergence",
    "make_batches",
    "train_distributed",
    "train_many",
    "train_reference",
    "trainable_numel",
]


def make_batches(
    steps: int, accum: int, batch: int, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``steps * accum`` micro-batches ``(x, y, mask)`` of ``batch`` samples (the global batch).

    The mask follows a cycle of three optimizer steps (all micro-batches of a step alike):
    nobody flagged (no rank uses ``extra``: its grad must stay None); only sample 0 flagged
    (only rank 0's shard uses it); random flags.
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps * accum):
        x = torch.randn(batch, 8, generator=g)
        y = torch.randint(0, 4, (batch,), generator=g)
        mask = torch.zeros(batch, dtype=torch.bool)
        kind = (i // accum) % 3
        if kind == 1:
            mask[0] = True
        elif kind == 2:
            mask = torch.rand(batch, generator=g) < 0.3
        out.append((x, y, mask))
    return out


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def train_reference(
    steps: int = 4, accum: int = 1, batch: int = 12, seed: int = 0
) -> list[Snapshot]:
    """Single-process training on the full micro-batches; parameters after each step."""
    torch.manual_seed(seed)
    model = AwkwardNet()
    batches = make_batches(steps, accum, batch, seed)
    per_step = [batches[s * accum : (s + 1) * accum] for s in range(steps)]
    trace = _reference_loop(model, _optimizer(model), per_step, _loss)
    return trace.params


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x, mask), y)


def train_distributed(
    wrap: Callable[[nn.Module], nn.Module],
    steps: int = 4,
    accum: int = 1,
    batch: int = 12,
    seed: int = 0,
    group: Any = None,
    set_to_none: bool = True,
) -> tuple[list[Snapshot], list[int]]:
    """Run on every rank: ``wrap(model)`` trained on this rank's shard of each micro-batch.

    ``wrap`` builds the data-parallel wrapper (ours, or torch DDP). Returns the parameters
    after each step and, for labkit's wrappers, the number of gradient elements reduced per
    step (tied weights counted once). Micro-batches ``0 .. accum-2`` of a step run inside
    ``no_sync()``. ``set_to_none=False`` zeroes the ``.grad`` tensors between steps instead of
    dropping them (backward then accumulates into them in place; a parameter unused in a
    step then gets a zero gradient and moves with momentum, unlike the reference).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if batch % world:
        raise ValueError(f"batch={batch} must be divisible by world_size={world}")
    torch.manual_seed(seed + 1000 * rank)  # different on purpose: the broadcast must fix it
    model = wrap(AwkwardNet())
    inner: nn.Module = getattr(model, "module", model)
    opt = _optimizer(inner)
    batches = make_batches(steps, accum, batch, seed)
    snaps, reduced = [], []
    for s in range(steps):
        for m, (x, y, mask) in enumerate(batches[s * accum : (s + 1) * accum]):
            shard = slice(rank * batch // world, (rank + 1) * batch // world)  # contiguous shard
            last = m == accum - 1
            ctx = contextlib.nullcontext() if last else model.no_sync()  # type: ignore[operator]
            with ctx:
                out = model(x[shard], mask[shard])
                (F.cross_entropy(out, y[shard]) / accum).backward()
        finish = getattr(model, "finish_gradient_sync", None)
        if finish is not None:
            finish()
            reduced.append(int(model.elements_reduced))  # type: ignore[arg-type]
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        snaps.append(snapshot(inner.named_parameters()))
    return snaps, reduced


def trainable_numel() -> int:
    """Gradient elements one sync must reduce: every trainable parameter, tied ones once."""
    return sum(p.numel() for p in AwkwardNet().parameters() if p.requires_grad)


def train_many(
    wraps: dict[str, Callable[[nn.Module], nn.Module]],
    steps: int = 4,
    accum: int = 1,
    group: Any = None,
) -> dict[str, list[Snapshot]]:
    """Run on every rank: :func:`train_distributed` for each wrapper.

    Returns each wrapper's parameters per step, by name."""
    return {
        name: train_distributed(wrap, steps, accum, group=group)[0] for name, wrap in wraps.items()
    }
