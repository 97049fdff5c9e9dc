"""Context parallelism: ring attention and Ulysses equal full attention on one process.

One warm 4-rank world runs every distributed case (cp = 2 on two pairs, cp = 4 on all four,
causal and not, zigzag and contiguous, cp x tp and dp x cp through the layout) and returns
local shards; the test process unshards them and compares with torch's
``scaled_dot_product_attention`` (outputs and Q/K/V gradients, float32). Negative controls
ride along: a merge without the log-sum-exp rescale, shards mislabelled as zigzag, and a
dense gradient averaged over dp only are each rejected by the same comparison.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from labkit.context_parallel import (
    blockwise_attention,
    causal_blocks,
    merge,
    ring_attention,
    shard_sequence,
    unshard_sequence,
)
from labkit.context_parallel.cost import (
    flash_attention_bytes,
    ring_activation_bytes,
    ring_sent_per_step,
)
from labkit.parallel import ParallelDegrees, rank_grid
from tests.ranks import run_ranks

B, H, S, D = 2, 4, 16, 8  # batch, heads, sequence, head dim: 2 cp chunks of 2 at cp = 4
ATOL = 2e-5  # float32 blockwise sums against torch's kernel; measured error is ~1e-6


def _full(seed: int) -> list[torch.Tensor]:
    """q, k, v and the upstream gradient dO, (B, H, S, D) float32."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, S, D, generator=g) for _ in range(4)]


def _reference(seed: int, causal: bool) -> list[torch.Tensor]:
    """Full attention on one process: [out, dq, dk, dv]."""
    q, k, v, dout = _full(seed)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(leaves[0], leaves[1], leaves[2], is_causal=causal)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]  # type: ignore[misc]


def _miss(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(got, want))


def test_blockwise_loop_equals_sdpa_and_needs_the_rescale() -> None:
    q, k, v, _ = _full(0)
    for causal in (False, True):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        for block in (1, 3, S):
            assert _miss([blockwise_attention(q, k, v, block, causal)], [want]) < ATOL
    # negative control: adding the two halves' outputs without exp(L_i - L) is wrong
    half = S // 2
    from labkit.context_parallel import block_forward

    a = block_forward(q, k[..., :half, :], v[..., :half, :], D**-0.5, None)
    b = block_forward(q, k[..., half:, :], v[..., half:, :], D**-0.5, None)
    right = merge(*a, *b)[0]
    assert _miss([right], [F.scaled_dot_product_attention(q, k, v)]) < ATOL
    assert _miss([(a[0] + b[0]) / 2], [right]) > 1e-2


def test_bad_sequences_and_degrees_are_refused_before_any_process() -> None:
    x = torch.zeros(1, 2, 12, 4)
    with pytest.raises(ValueError, match=r"sequence length 12 is not divisible by 2 x cp = 8"):
        shard_sequence(x, 4, 0)
    # odd local length: refused before the ring touches a process group (none exists here)
    with pytest.raises(ValueError, match=r"local sequence length 3 is not even"):
        ring_attention(x[..., :3, :], x[..., :3, :], x[..., :3, :])
    with pytest.raises(ValueError, match=r"scheme 'zag' is not one of"):
        ring_attention(x, x, x, scheme="zag")
    with pytest.raises(ValueError, match=r"ep=3 must divide dp x cp = 2 x 2 = 4"):
        ParallelDegrees(dp=2, cp=2, ep=3)
    with pytest.raises(ValueError, match=r"parallel degree cp=0"):
        ParallelDegrees(cp=0)
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by 2 x cp = 4"):
        ParallelDegrees(cp=2).check_model(hidden=8, heads=2, seq=10)
    with pytest.raises(ValueError, match=r"cp=2 = 8 ranks, but world_size=4"):
        ParallelDegrees(dp=2, tp=2, cp=2).check_world_size(4)


def test_rank_grid_places_cp_inside_dp_and_ep_inside_dp_cp() -> None:
    d = ParallelDegrees(dp=2, tp=2, pp=2, cp=2, ep=4)  # 16 ranks
    g = rank_grid(d)
    assert d.world_size == 16
    assert g["tp"][0] == [0, 1] and g["cp"][0] == [0, 2] and g["dp"][0] == [0, 4]
    assert g["pp"][0] == [0, 8] and g["dp_cp"][0] == [0, 2, 4, 6]
    assert g["ep"][0] == [0, 2, 4, 6] and g["edp"][0] == [0]  # ep = dp x cp: experts everywhere
    g2 = rank_grid(ParallelDegrees(dp=4, cp=1, ep=2))
    assert g2["ep"] == [[0, 1], [2, 3]] and g2["edp"] == [[0, 2], [1, 3]]
    for name, groups in g.items():  # every axis partitions the ranks
        assert sorted(r for grp in groups for r in grp) == list(range(16)), name
    assert set(rank_grid(ParallelDegrees(dp=2, tp=2))) == {"tp", "dp", "pp"}  # 3D stays 3D


def test_work_per_rank_contiguous_vs_zigzag() -> None:
    assert causal_blocks(4, "contiguous") == [3, 7, 11, 15]  # rank r: 4r + 3 tiles
    assert causal_blocks(4, "zigzag") == [9, 9, 9, 9]  # 2cp + 1 each, cp (2cp + 1) in all
    assert causal_blocks(4, "zigzag", causal=False) == [16] * 4


def _on_ranks(cases: list[dict[str, Any]]) -> dict[str, Any]:
    import torch.distributed as dist

    import labkit.context_parallel.ring as ring_mod
    from labkit.context_parallel import RingStats, ulysses_attention
    from labkit.parallel import build_layout

    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out: dict[str, Any] = {}
    for case in cases:
        name, cp, causal = case["name"], case["cp"], case["causal"]
        group, r = (None, rank) if cp == 4 else (pairs[rank // 2], rank % 2)
        q, k, v, dout = _full(case["seed"])
        scheme = case.get("scheme", "zigzag")
        split = case.get("split_as", scheme)
        leaves = [shard_sequence(t, cp, r, split).requires_grad_() for t in (q, k, v)]
        stats = RingStats()
        original = ring_mod.merge
        if case.get("wrong") == "no_rescale":  # negative control: plain average of blocks
            ring_mod.merge = lambda oa, la, ob, lb: (  # type: ignore[assignment]
                torch.where(torch.isfinite(la).unsqueeze(-1), (oa + ob) / 2, ob),
                torch.logaddexp(la, lb),
            )
        try:
            if case.get("ulysses"):
                o = ulysses_attention(*leaves, group=group, causal=causal)
            else:
                kernel = case.get("kernel", "auto")  # auto: torch's fused CPU tile kernel
                o = ring_attention(
                    *leaves, group=group, causal=causal, scheme=scheme, stats=stats, kernel=kernel
                )
        finally:
            ring_mod.merge = original
        o.backward(shard_sequence(dout, cp, r, split))
        out[name] = {
            "shards": [o.detach()] + [t.grad for t in leaves],
            "sent": stats.sent,
            "tiles": stats.tiles,
        }
    try:  # Ulysses with heads not divisible by cp: refused before the all-to-all
        ulysses_attention(*(torch.zeros(1, 3, 4, 2) for _ in range(3)))
    except ValueError as exc:
        out["ulysses_refusal"] = str(exc)
    # cp x tp: heads over tp, sequence over cp, the ring on the layout's cp group
    lay = build_layout(ParallelDegrees(tp=2, cp=2))
    q, k, v, dout = _full(7)
    hs = slice(lay.tp_rank * H // 2, (lay.tp_rank + 1) * H // 2)
    leaves = [shard_sequence(t[:, hs], 2, lay.cp_rank).requires_grad_() for t in (q, k, v)]
    o = ring_attention(*leaves, group=lay.cp_group, causal=True)
    o.backward(shard_sequence(dout[:, hs], 2, lay.cp_rank))
    out["tp_cp"] = {
        "at": (lay.tp_rank, lay.cp_rank),
        "shards": [o.detach()] + [t.grad for t in leaves],
    }
    # dp x cp: a projection's weight gradient is summed over dp_cp (dp alone misses half)
    lay = build_layout(ParallelDegrees(dp=2, cp=2, ep=2))
    out["groups"] = {
        n: dist.get_process_group_ranks(getattr(lay, f"{n}_group"))
        for n in ("dp", "cp", "dp_cp", "ep", "edp")
    }
    out["dp_cp"] = _projection_grad(lay)
    return out


def _projection_grad(lay) -> dict:
    import torch.distributed as dist

    g = torch.Generator().manual_seed(3)
    x, w, gout = (
        torch.randn(2, S, 8, generator=g),
        torch.randn(8, 24, generator=g),
        torch.randn(2, 2, S, 4, generator=g),
    )
    w = w.requires_grad_()
    xs = shard_sequence(x[lay.dp_rank : lay.dp_rank + 1], 2, lay.cp_rank, dim=1)  # (1, S/2, 8)
    q, k, v = (xs @ w).reshape(1, S // 2, 3, 2, 4).permute(2, 0, 3, 1, 4)  # 3 x (1, 2, S/2, 4)
    o = ring_attention(q, k, v, group=lay.cp_group, causal=True)
    (o * shard_sequence(gout[lay.dp_rank : lay.dp_rank + 1], 2, lay.cp_rank)).sum().backward()
    right, wrong = w.grad.clone(), w.grad.clone()  # type: ignore[union-attr]
    dist.all_reduce(right, group=lay.dp_cp_group)
    dist.all_reduce(wrong, group=lay.dp_group)
    return {"right": right, "wrong": wrong}


def _projection_reference() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x, w, gout = (
        torch.randn(2, S, 8, generator=g),
        torch.randn(8, 24, generator=g),
        torch.randn(2, 2, S, 4, generator=g),
    )
    w = w.requires_grad_()
    q, k, v = (x @ w).reshape(2, S, 3, 2, 4).permute(2, 0, 3, 1, 4)
    (F.scaled_dot_product_attention(q, k, v, is_causal=True) * gout).sum().backward()
    return w.grad  # type: ignore[return-value]


CASES: list[dict[str, Any]] = [
    {"name": f"ring cp={cp} causal={c} {sch}", "cp": cp, "causal": c, "scheme": sch, "seed": i}
    for i, (cp, c, sch) in enumerate(
        [(2, False, "zigzag"), (2, True, "zigzag"), (4, False, "zigzag"), (4, True, "zigzag"),
         (4, True, "contiguous"), (2, True, "contiguous")]
    )
] + [
    {"name": f"ring cp={cp} causal={c} reference tiles", "cp": cp, "causal": c, "seed": 30 + cp,
     "kernel": "reference"}
    for cp, c in [(2, False), (4, True)]
] + [
    {"name": f"ulysses cp={cp} causal={c}", "cp": cp, "causal": c, "scheme": "contiguous",
     "ulysses": True, "seed": 10 + cp}
    for cp, c in [(2, True), (4, False)]
]  # fmt: skip
WRONG: list[dict[str, Any]] = [
    {"name": "no rescale", "cp": 4, "causal": True, "seed": 20, "wrong": "no_rescale"},
    {"name": "mislabelled split", "cp": 4, "causal": True, "seed": 21, "split_as": "contiguous"},
]


def test_ring_and_ulysses_equal_full_attention_on_4_ranks() -> None:
    results = run_ranks(_on_ranks, CASES + WRONG, world_size=4, timeout=180)
    for case in CASES + WRONG:
        cp, name = case["cp"], case["name"]
        split = case.get("split_as", case.get("scheme", "zigzag"))
        for first in (0, 2) if cp == 2 else (0,):  # both pairs ran the cp = 2 cases
            ranks = [results[first + r][name] for r in range(cp)]
            got = [unshard_sequence([rk["shards"][i] for rk in ranks], split) for i in range(4)]
            miss = _miss(got, _reference(case["seed"], case["causal"]))
            if case in WRONG:
                assert miss > 1e-2, f"{name}: the wrong approach went unseen ({miss:.2e})"
                continue
            assert miss < ATOL, f"{name}: max |diff| {miss:.2e} over out, dq, dk, dv"
            if case.get("ulysses"):
                continue
            # bytes sent per step, counted, against the formula (float32: 4 bytes)
            want = ring_sent_per_step(B, H, S, D, cp, elem=4)
            assert all(rk["sent"] == want for rk in ranks), (name, ranks[0]["sent"], want)
            if case["causal"]:  # forward tiles per rank: the imbalance (or its absence)
                work = [sum(rk["tiles"][:cp]) for rk in ranks]
                assert work == causal_blocks(cp, case.get("scheme", "zigzag")), (name, work)
    assert "head count divisible by cp: 3 heads over cp=4" in results[0]["ulysses_refusal"]
    # cp x tp: reassemble heads (tp) and sequence (cp)
    tp_want = _reference(7, True)
    by_pos = {res["tp_cp"]["at"]: res["tp_cp"]["shards"] for res in results}
    for i in range(4):
        heads = [unshard_sequence([by_pos[(t, c)][i] for c in range(2)]) for t in range(2)]
        assert _miss([torch.cat(heads, dim=1)], [tp_want[i]]) < ATOL, ("tp x cp", i)
    # dp x cp through the layout: its groups, and the weight gradient summed over dp_cp
    grid = rank_grid(ParallelDegrees(dp=2, cp=2, ep=2))
    for rank, res in enumerate(results):
        for n, ranks_ in res["groups"].items():
            assert ranks_ == next(g for g in grid[n] if rank in g), (rank, n)
    ref = _projection_reference()
    size = ref.abs().max().item()  # a sum over 32 tokens: relative float32 tolerance
    for res in results:
        assert _miss([res["dp_cp"]["right"]], [ref]) < 1e-5 * size
        assert _miss([res["dp_cp"]["wrong"]], [ref]) > 1e-2 * size  # dp alone: half the tokens


def test_saved_bytes_equal_flash_bytes_over_cp() -> None:
    """What ring attention saves for backward on one rank is the formula's ``/ cp``."""
    assert ring_activation_bytes(B, H, S, D, 4, 4) * 4 == flash_attention_bytes(B, H, S, D, 4)


def test_merge_check_accepts_the_rule_and_rejects_three_wrong_merges() -> None:
    from labkit.checks.context_parallel import check_merge
    from labkit.checks.core import CheckFailed

    check_merge(merge)

    def no_rescale(oa, la, ob, lb):  # type: ignore[no-untyped-def]
        return (oa + ob) / 2, torch.logaddexp(la, lb)

    def nan_on_empty(oa, la, ob, lb):  # type: ignore[no-untyped-def]
        lse = torch.logaddexp(la, lb)
        return torch.exp(la - lse)[..., None] * oa + torch.exp(lb - lse)[..., None] * ob, lse

    def wrong_lse(oa, la, ob, lb):  # type: ignore[no-untyped-def]
        return merge(oa, la, ob, lb)[0], torch.maximum(la, lb)

    for wrong, why in [(no_rescale, "two halves"), (nan_on_empty, "NaN"), (wrong_lse, "chain")]:
        with pytest.raises(CheckFailed, match=why):
            check_merge(wrong)


def test_float64_tiles_stay_float64_through_the_fused_backward() -> None:
    """Issue 34, defect 8: the fused CPU backward wants the LSE in its own accumulation dtype
    (float64 for float64 inputs); ring attention used to hand it a float32 one and raise
    "expected scalar type Double but found Float". The readable tiles are the reference."""
    from labkit.context_parallel.blockwise import tile_backward, tile_forward

    q, k, v, dout = (t[..., :4, :].double() for t in _full(5))  # (B, H, 4, D) float64
    scale = D**-0.5
    for diag in (False, True):
        fused = tile_forward(q, k, v, scale, diag, True)
        ref = tile_forward(q, k, v, scale, diag, False)
        assert fused[0].dtype == fused[1].dtype == ref[1].dtype == torch.float64
        assert _miss(list(fused), list(ref)) < 1e-12
        out, lse = ref
        delta = (dout * out).sum(-1)
        got = tile_backward(q, k, v, dout, out, lse, delta, scale, diag, True)
        want = tile_backward(q, k, v, dout, out, lse, delta, scale, diag, False)
        assert all(g.dtype == torch.float64 for g in got)
        assert _miss(list(got), list(want)) < 1e-12
        # the old hand-over, a float32 LSE, is converted rather than refused
        assert _miss(list(tile_backward(q, k, v, dout, out, lse.float(), delta, scale, diag,
                                        True)), list(want)) < 1e-6  # fmt: skip
