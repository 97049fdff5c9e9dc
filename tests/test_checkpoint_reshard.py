"""Resharding as pure functions, without processes: which elements of which saved shards make
up a new shard (labkit/checkpoint/reshard.py). Every shard of one layout is rebuilt from the
shards of another (tensor-parallel cuts along dim 0 and 1, ZeRO ranges of them, replicated
tensors, a scalar) and compared with the slice of the full tensor; the naive flat-slice
reading of a row-parallel shard is shown wrong; gaps, double writes and bad cuts are refused.
"""

from __future__ import annotations

import pytest
import torch

from labkit.checkpoint import Place, check_split, plan_read
from labkit.checkpoint.reshard import overlaps, runs, tp_place


def _cut(full: torch.Tensor, p: Place) -> torch.Tensor:
    """The elements of place ``p`` of ``full``, row-major (what a rank stores), (numel,)."""
    box = full[tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes))].reshape(-1)
    return box if p.flat is None else box[p.flat[0] : p.flat[1]]


def _rebuild(full: torch.Tensor, saved: list[Place], want: Place) -> torch.Tensor:
    plan, covered = plan_read(saved, want)
    assert covered == want.numel
    out = torch.full((want.numel,), -1.0)
    for k, src, dst, n in plan:
        out[dst : dst + n] = _cut(full, saved[k])[src : src + n]
    return out


def test_any_shard_rebuilt_from_any_other_layout() -> None:
    """tp 2 -> 4 along dim 0 (column-parallel) and dim 1 (row-parallel), from ZeRO ranges
    of 3 dp ranks to ZeRO ranges of 2 of another tp size; a replicated tensor; a scalar."""
    full = torch.arange(8 * 8.0).reshape(8, 8)  # (8, 8)
    for dim in (0, 1):
        boxes = [tp_place((8, 8), dim, r, 2) for r in range(2)]  # 32 elements each
        saved = [Place(b.shape, b.offsets, b.sizes, (lo, min(lo + 11, 32)))  # ZeRO 3 ways
                 for b in boxes for lo in (0, 11, 22)]  # fmt: skip
        for r in range(4):
            box = tp_place((8, 8), dim, r, 4)  # 16 elements
            for want in (box, Place(box.shape, box.offsets, box.sizes, (5, 12))):
                assert torch.equal(_rebuild(full, saved, want), _cut(full, want)), (dim, want)
        # the wrong approach: a dim-1 (row-parallel) shard is not a flat slice of the tensor
        naive = full.reshape(-1)[:32]
        assert torch.equal(naive, _cut(full, boxes[0])) == (dim == 0)
    assert torch.equal(_rebuild(full, [Place.whole((8, 8))], tp_place((8, 8), None, 1, 4)),
                       full.reshape(-1))  # fmt: skip
    scalar = torch.tensor(3.0)
    assert torch.equal(_rebuild(scalar, [Place.whole(())], Place.whole(())), scalar.reshape(1))


def test_runs_overlaps_and_refusals() -> None:
    assert runs(tp_place((6, 8), 0, 1, 2)) == [(24, 24)]  # a dim-0 cut: one run
    assert runs(tp_place((6, 8), 1, 1, 2)) == [(4 + 8 * i, 4) for i in range(6)]  # one per row
    assert runs(Place((6, 8), (0, 4), (6, 4), (2, 6))) == [(6, 2), (12, 2)]
    assert overlaps([(0, 10)], [(4, 2), (8, 4)]) == [(4, 0, 2), (8, 2, 2)]
    half = [tp_place((6, 8), 0, 0, 2)]  # the other tp shard is missing
    assert plan_read(half, Place.whole((6, 8)))[1] == 24
    with pytest.raises(ValueError, match="overlap"):  # a replica written twice
        plan_read([Place.whole((6, 8)), tp_place((6, 8), 0, 0, 2)], Place.whole((6, 8)))
    with pytest.raises(ValueError, match="leaves the tensor"):
        Place((6, 8), (4, 0), (4, 8))
    with pytest.raises(ValueError, match=r"'model/q' of shape \(32, 32\) cannot be cut into "
                       r"tp=3 shards of shape \(32/3, 32\)"):  # fmt: skip
        check_split("model/q", (32, 32), 0, 3)
