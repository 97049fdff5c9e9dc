"""Partitioning: where each parameter lives in a flat buffer, and which rank owns what.

ZeRO keeps a group of parameters as ONE flat fp32 buffer so that a single reduce-scatter
hands every rank its contiguous shard of the gradients and a single all-gather rebuilds the
parameters. Layout for parameters of ``numels = (5, 3, 3)`` on ``world_size = 3``::

    flat  : [ p0 p0 p0 p0 p0 | p1 p1 p1 | p2 p2 p2 | pad ]   total 11, padded 12
    shards: [ rank 0: 0..4 ][ rank 1: 4..8 ][ rank 2: 8..12 ]  shard_size 4

p0 straddles ranks 0 and 1: rank 0 owns its elements 0..4, rank 1 its element 4.

Invariants (tested without processes):

* ``padded`` is the smallest multiple of ``world_size`` >= ``total``; the padding (< world_size
  elements) sits at the end, is zero, and stays zero under Adam (its gradient is zero);
* shards are disjoint, equal-sized, and their union is ``[0, padded)``;
* each parameter element belongs to exactly one rank; :meth:`FlatLayout.pieces` lists, for a
  rank, the parameter slices it owns and where they sit inside its shard.

The layout is a plain function of sizes (no tensors, no processes). :class:`Unit` is one
flat buffer's parameters and this rank's tensors for them; :func:`make_units` decides which
parameters share a buffer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = [
    "FlatLayout",
    "Piece",
    "Unit",
    "flat_layout",
    "flatten_into",
    "make_units",
    "param_views",
]


@dataclass(frozen=True)
class Piece:
    """Elements ``[param_start, param_start + length)`` of parameter ``param`` live on ``rank``,
    at ``[shard_start, shard_start + length)`` of that rank's shard."""

    param: int
    rank: int
    param_start: int
    shard_start: int
    length: int


@dataclass(frozen=True)
class FlatLayout:
    numels: tuple[int, ...]
    world_size: int
    offsets: tuple[int, ...]  # where parameter i starts in the flat buffer
    total: int  # sum(numels)
    padded: int  # total rounded up to a multiple of world_size
    shard_size: int  # padded // world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s shard in the flat buffer."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world_size {self.world_size}")
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def pieces(self, rank: int) -> list[Piece]:
        """The parameter slices owned by ``rank``, in flat order."""
        lo, hi = self.shard_range(rank)
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(lo, off), min(hi, off + n)  # intersection of [off, off+n) and the shard
            if a < b:
                out.append(Piece(i, rank, a - off, a - lo, b - a))
        return out

    def owners(self, param: int) -> list[Piece]:
        """Every rank's piece of parameter ``param`` (1, or several if it straddles shards)."""
        return [p for r in range(self.world_size) for p in self.pieces(r) if p.param == param]


def flat_layout(numels: Sequence[int], world_size: int) -> FlatLayout:
    """Lay ``numels`` end to end and cut the (padded) result into ``world_size`` equal shards."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if any(n < 0 for n in numels):
        raise ValueError(f"parameter sizes must be >= 0, got {list(numels)}")
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += n
    padded = -(-total // world_size) * world_size  # ceil to a multiple of world_size
    return FlatLayout(
        tuple(numels), world_size, tuple(offsets), total, padded, padded // world_size
    )


def param_views(
    flat: torch.Tensor, layout: FlatLayout, shapes: Sequence[torch.Size]
) -> list[torch.Tensor]:
    """Views of ``flat`` (padded,) shaped like each parameter: writing one writes the buffer."""
    return [flat[o : o + n].view(s) for o, n, s in zip(layout.offsets, layout.numels, shapes)]


def flatten_into(
    flat: torch.Tensor, layout: FlatLayout, tensors: Sequence[torch.Tensor | None]
) -> torch.Tensor:
    """Copy ``tensors`` into ``flat`` at their offsets (None -> zeros), padding zeroed."""
    for o, n, t in zip(layout.offsets, layout.numels, tensors):
        if t is None:
            flat[o : o + n].zero_()
        else:
            flat[o : o + n].copy_(t.reshape(-1))
    flat[layout.total :].zero_()
    return flat


def _empty() -> torch.Tensor:
    return torch.empty(0)


@dataclass(eq=False)
class Unit:
    """Parameters that share one flat buffer, and this rank's tensors for them.

    Which tensors exist depends on the stage: ``flat`` is the full (padded,) parameters in the
    compute dtype (None while ZeRO-3 has sharded them away), ``shard`` this rank's slice of
    them, ``master`` its fp32 copy (``shard`` itself in fp32 training), ``grad`` the full
    gradients (stages 0-1) or this rank's gradient shard (stages 2-3), ``exp_avg`` and
    ``exp_avg_sq`` Adam's moments of ``master``, ``steps`` Adam's step count per parameter.
    """

    owner: nn.Module  # ZeRO-3 gathers the unit around this module's forward and backward
    params: list[nn.Parameter]
    names: list[str]
    layout: FlatLayout
    shapes: list[torch.Size]  # recorded once: a sharded-away parameter has shape (0,)
    flat: torch.Tensor | None = None
    shard: torch.Tensor = field(default_factory=_empty)
    master: torch.Tensor = field(default_factory=_empty)
    grad: torch.Tensor = field(default_factory=_empty)
    exp_avg: torch.Tensor = field(default_factory=_empty)
    exp_avg_sq: torch.Tensor = field(default_factory=_empty)
    steps: list[int] = field(default_factory=list)


def make_units(
    model: nn.Module, world_size: int, wrap: Sequence[nn.Module] | None = None
) -> list[Unit]:
    """Group the trainable parameters of ``model`` into units, each laid out for ``world_size``.

    ``wrap=None``: one unit per module that owns trainable parameters directly (finest
    grain: least memory in ZeRO-3, most collectives). ``wrap=[blocks...]``: one unit per
    listed module (all its parameters), the rest in one unit owned by ``model`` (FSDP's
    wrapping policy). A shared (tied) parameter goes to the first unit that meets it; frozen
    parameters (``requires_grad=False``) go to none.
    """
    seen: set[int] = set()
    names = {id(p): n for n, p in model.named_parameters()}
    units: list[Unit] = []

    def take(owner: nn.Module, params: Iterable[nn.Parameter]) -> None:
        mine = [p for p in params if p.requires_grad and id(p) not in seen]
        mine = list({id(p): p for p in mine}.values())  # a module may list a parameter twice
        seen.update(id(p) for p in mine)
        if mine:
            layout = flat_layout([p.numel() for p in mine], world_size)
            shapes = [p.shape for p in mine]
            units.append(Unit(owner, mine, [names[id(p)] for p in mine], layout, shapes))

    if wrap is None:
        for mod in model.modules():
            take(mod, mod.parameters(recurse=False))
    else:
        for mod in wrap:
            take(mod, mod.parameters())
        take(model, model.parameters())
    return units
