"""Resharding as pure functions: which elements of which saved shards make up a new shard.

Every shard of a logical tensor (global shape ``S``) is a :class:`Place`: a box (``offsets``,
``sizes``: a tensor-parallel cut of the full tensor) and, optionally, a flat range
``[start, end)`` of that box's row-major elements (a ZeRO partition of the flattened shard).
Either way the shard's elements are a *sorted set of global flat indices*, stored in
increasing order, which :func:`runs` lists as contiguous runs ``(global_start, length)``.

Reading a new layout's shard from an old layout's shards is then one merge of two sorted run
lists (:func:`overlaps`), whatever the two layouts were (tp 2 -> 4, a ZeRO range of 3 ranks
from shards of 2, a pipeline stage's tensors from any stage...): a copy
``new[dst : dst + n] = saved_k[src : src + n]`` for every overlap, and a coverage count that
must reach the new shard's size (:func:`plan_read`), or some saved shard is missing.

Run counts: a box cut along dim 0 of a row-major tensor is one run; a cut along dim ``j``
gives ``prod(sizes[:j])`` runs (one per row for a row-parallel weight ``(out, in / t)``).
Shapes are row-major: the global flat index of ``(i_0, ..., i_k)`` is
``sum_j i_j * prod(S[j + 1:])``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Place", "check_split", "overlaps", "plan_read", "runs", "tp_place"]

Run = tuple[int, int]  # (global flat start, length)


@dataclass(frozen=True)
class Place:
    """Where one shard sits in its logical tensor of global ``shape``: the box
    ``[offsets, offsets + sizes)`` and, within the box's row-major elements, ``flat``
    (``[start, end)``; None: the whole box)."""

    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not len(self.shape) == len(self.offsets) == len(self.sizes):
            raise ValueError(f"{self}: shape, offsets and sizes must have the same length")
        for d, (n, o, s) in enumerate(zip(self.shape, self.offsets, self.sizes)):
            if not (0 <= o and 0 <= s and o + s <= n):
                raise ValueError(f"{self}: the box leaves the tensor along dim {d}")
        box = math.prod(self.sizes)
        if self.flat is not None and not 0 <= self.flat[0] <= self.flat[1] <= box:
            raise ValueError(f"{self}: flat range outside the box's {box} elements")

    @property
    def numel(self) -> int:
        return math.prod(self.sizes) if self.flat is None else self.flat[1] - self.flat[0]

    @classmethod
    def whole(cls, shape: Sequence[int], flat: tuple[int, int] | None = None) -> Place:
        shape = tuple(shape)
        return cls(shape, (0,) * len(shape), shape, flat)


def tp_place(shape: Sequence[int], dim: int | None, rank: int, size: int) -> Place:
    """The box tensor-parallel rank ``rank`` of ``size`` holds: the ``rank``-th equal cut along
    ``dim`` (None: replicated, the whole tensor). Megatron's even split; see :func:`check_split`."""
    shape = tuple(shape)
    if dim is None or size == 1:
        return Place.whole(shape)
    n = shape[dim] // size
    offsets = tuple(rank * n if d == dim else 0 for d in range(len(shape)))
    sizes = tuple(n if d == dim else s for d, s in enumerate(shape))
    return Place(shape, offsets, sizes)


def check_split(key: str, shape: Sequence[int], dim: int | None, size: int) -> None:
    """Raise unless tensor ``key`` of ``shape`` cuts into ``size`` equal shards along ``dim``,
    naming the tensor, its shape and the shard shape it would need."""
    if dim is None or shape[dim] % size == 0:
        return
    want = [f"{s}/{size}" if d == dim else str(s) for d, s in enumerate(shape)]
    raise ValueError(
        f"tensor {key!r} of shape {tuple(shape)} cannot be cut into tp={size} shards of shape "
        f"({', '.join(want)}): {shape[dim]} is not divisible by {size} (dim {dim})"
    )


def runs(place: Place) -> list[Run]:
    """The shard's elements as sorted, merged runs ``(global_start, length)`` of the global
    row-major flattening; the shard stores them in this order."""
    shape, off, size = place.shape, place.offsets, place.sizes
    if math.prod(size) == 0:
        return []
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    # the innermost dims the box spans fully merge into one run with the dim outside them
    j = len(shape) - 1
    while j > 0 and off[j] == 0 and size[j] == shape[j]:
        j -= 1
    length = (size[j] if shape else 1) * (strides[j] if shape else 1)
    base = off[j] * strides[j] if shape else 0
    out: list[Run] = []
    for idx in itertools.product(*(range(o, o + s) for o, s in zip(off[:j], size[:j]))):
        start = base + sum(i * st for i, st in zip(idx, strides))
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((start, length))
    if place.flat is None:
        return out
    lo, hi = place.flat  # keep box elements [lo, hi): walk the runs in box order
    cut: list[Run] = []
    pos = 0
    for start, n in out:
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            cut.append((start + a - pos, b - a))
        pos += n
    return cut


def overlaps(src: Sequence[Run], dst: Sequence[Run]) -> list[tuple[int, int, int]]:
    """Every common stretch of two sorted run lists as ``(src_pos, dst_pos, length)``: the
    positions in each shard's stored order. One merge, O(len(src) + len(dst))."""
    out = []
    i = j = src_pos = dst_pos = 0
    while i < len(src) and j < len(dst):
        (s, sn), (d, dn) = src[i], dst[j]
        a, b = max(s, d), min(s + sn, d + dn)
        if a < b:
            out.append((src_pos + a - s, dst_pos + a - d, b - a))
        if s + sn <= d + dn:  # advance whichever run ends first
            src_pos += sn
            i += 1
        else:
            dst_pos += dn
            j += 1
    return out


def plan_read(saved: Sequence[Place], want: Place) -> tuple[list[tuple[int, int, int, int]], int]:
    """The copies that build shard ``want`` from ``saved`` shards of the same tensor:
    ``(saved_index, src_pos, dst_pos, length)``, and how many of want's elements they cover
    (== ``want.numel`` unless a shard is missing; overlapping saved shards are refused)."""
    for k, p in enumerate(saved):
        if p.shape != want.shape:
            raise ValueError(f"saved shard {k} is of a tensor of shape {p.shape}, not {want.shape}")
    dst = runs(want)
    plan = [(k, *o) for k, p in enumerate(saved) for o in overlaps(runs(p), dst)]
    covered = sum(n for *_, n in plan)
    marks = sorted((d, d + n) for _, _, d, n in plan)
    if any(b > c for (_, b), (c, _) in zip(marks, marks[1:])):
        raise ValueError(f"saved shards of a tensor of shape {want.shape} overlap: a replica "
                         f"was written twice")  # fmt: skip
    return plan, covered
