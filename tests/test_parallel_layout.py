"""The parallel layout: validated degrees, the Megatron rank grid, and DeviceMesh groups on gloo."""

from __future__ import annotations

import pytest

from labkit.parallel import ParallelDegrees, rank_grid
from tests.ranks import run_ranks


def test_bad_degrees_name_every_value() -> None:
    with pytest.raises(ValueError) as err:
        ParallelDegrees(dp=2, tp=4, pp=2).check_world_size(12)
    for text in ("dp=2", "tp=4", "pp=2", "16", "world_size=12"):
        assert text in str(err.value)
    with pytest.raises(ValueError, match=r"tp=0"):
        ParallelDegrees(tp=0)
    with pytest.raises(ValueError, match=r"hidden size 100 .* tp=8"):
        ParallelDegrees(tp=8).check_model(hidden=100, heads=8)
    with pytest.raises(ValueError, match=r"head count 6 .* tp=4"):
        ParallelDegrees(tp=4).check_model(hidden=96, heads=6)
    with pytest.raises(ValueError, match=r"vocabulary 65 .* tp=2 .*66"):
        ParallelDegrees(tp=2).check_model(hidden=64, heads=4, vocab=65)
    ParallelDegrees(tp=2).check_model(hidden=64, heads=4, vocab=64)  # divisible: no error


def test_rank_grid_64_ranks_keeps_tp_adjacent() -> None:
    grid = rank_grid(ParallelDegrees(dp=1, tp=8, pp=8))  # 64 ranks: 8 stages of one 8-way tp group
    assert grid["tp"] == [list(range(8 * i, 8 * i + 8)) for i in range(8)]  # a node's 8 GPUs
    assert grid["pp"] == [list(range(j, 64, 8)) for j in range(8)]  # stages stride across nodes
    assert grid["dp"] == [[r] for r in range(64)]
    g = rank_grid(ParallelDegrees(dp=2, tp=4, pp=8))
    assert (
        g["tp"][0] == [0, 1, 2, 3] and g["dp"][0] == [0, 4] and g["pp"][0] == list(range(0, 64, 8))
    )
    for name in ("tp", "dp", "pp"):  # every axis partitions the ranks
        assert sorted(r for group in g[name] for r in group) == list(range(64))


def test_rank_grid_in_another_order_numbers_dp_innermost() -> None:
    d = ParallelDegrees(dp=2, tp=3, pp=2)  # dp-tp-pp: rank = pp_i (tp dp) + tp_i dp + dp_i
    g = rank_grid(d, "dp-tp-pp")
    assert g["dp"][:2] == [[0, 1], [2, 3]] and g["tp"][0] == [0, 2, 4]
    assert g["pp"][0] == [0, 6]
    assert rank_grid(d, "tp-dp-pp") == rank_grid(d)  # Megatron's order is the default
    with pytest.raises(ValueError, match=r"rank order 'tp-tp-pp' must name each of"):
        rank_grid(d, "tp-tp-pp")


def _layout_groups(dp: int, tp: int, pp: int) -> dict[str, list[int]]:
    import torch.distributed as dist

    from labkit.parallel import build_layout, global_rank

    layout = build_layout(ParallelDegrees(dp=dp, tp=tp, pp=pp))
    out = {}
    for name in ("tp", "dp", "pp"):
        group = getattr(layout, f"{name}_group")
        out[name] = [global_rank(group, r) for r in range(dist.get_world_size(group))]
    return out


def test_build_layout_on_4_gloo_ranks_equals_rank_grid() -> None:
    degrees = ParallelDegrees(dp=2, tp=2, pp=1)
    results = run_ranks(_layout_groups, 2, 2, 1, world_size=4, timeout=120)
    grid = rank_grid(degrees)
    for rank, groups in enumerate(results):
        for name in ("tp", "dp", "pp"):
            expected = next(g for g in grid[name] if rank in g)
            assert groups[name] == expected, (rank, name)
