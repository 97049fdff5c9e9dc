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

Everything here is a plain function of sizes: no tensors, no processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Piece", "FlatLayout", "flat_layout", "flatten_into", "param_views"]


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
        """Every rank's piece of parameter ``param`` (1 piece, or several if it straddles shards)."""
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
    return FlatLayout(tuple(numels), world_size, tuple(offsets), total, padded, padded // world_size)


def param_views(flat: torch.Tensor, layout: FlatLayout, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Views of ``flat`` (padded,) shaped like each parameter: writing one writes the buffer."""
    return [flat[o : o + n].view(s) for o, n, s in zip(layout.offsets, layout.numels, shapes)]


def flatten_into(flat: torch.Tensor, layout: FlatLayout, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """Copy ``tensors`` into ``flat`` at their offsets (None -> zeros), padding zeroed."""
    for o, n, t in zip(layout.offsets, layout.numels, tensors):
        if t is None:
            flat[o : o + n].zero_()
        else:
            flat[o : o + n].copy_(t.reshape(-1))
    flat[layout.total :].zero_()
    return flat
