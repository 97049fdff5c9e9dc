"""The spec of the two-level all-reduce: equal to dist.all_reduce, NCCL-safe, one clear error.

One ``run_ranks`` call per world size (4 and 6) runs every node layout of that world
(2x2, 1x4, 4x1; 2x3, 3x2, 6x1, 1x6) over shapes x dtypes x ops, records every
point-to-point call, checks bad arguments and ``Comm(impl="hierarchical")``. Each rank builds
every rank's input from a seed, so it also knows the exact (float64) result.

Tolerances (``eps``: the dtype's machine epsilon, ``S = sum |x_i|`` over the ``p`` ranks):
* against the exact result: ``eps * |exact| + p * eps32 * S`` (the bound the module states:
  float32 partials through both levels, one rounding);
* against ``dist.all_reduce``: ``p * eps * S`` (a ``p``-term sum rounded at every hop);
* MAX and MIN are exact, and every rank holds the bit-identical result.
"""

from __future__ import annotations

import math
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from labkit.collectives import cost_model as cm
from labkit.collectives.nccl_order import P2PCall, nccl_problems
from labkit.collectives.primitives import CONTROL_TAG
from tests.ranks import run_ranks, value_errors

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks cannot import tests/

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN)
LAYOUTS = {4: (2, 4, 1), 6: (3, 2, 1, 6)}  # ranks_per_node for each world size


def _grid(k: int, p: int) -> list[tuple[tuple[int, ...], torch.dtype, object]]:
    """Every case of a layout: all shapes x dtypes x ops on a real two-level layout; a few on
    the degenerate ones (one node: ``k = p``; one rank per node: ``k = 1``)."""
    if 1 < k < p:  # 0-d, empty, fewer elements than a node's ranks, uneven, 2-d, divisible
        shapes = list(dict.fromkeys([(), (0,), (k - 1,), (p + 1,), (3, 67), (4 * p,)]))
        return [(s, d, op) for s in shapes for d in DTYPES for op in OPS]
    few = (torch.float32, torch.bfloat16)
    return [(s, d, op) for s in [(p + 1,), (3, 67)] for d in few for op in OPS[:3]]


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, p: int, case: int) -> list[torch.Tensor]:
    return [
        torch.randn(shape, generator=torch.Generator().manual_seed(1000 * case + r)).to(dtype)
        for r in range(p)
    ]


def _problem(
    name: str, got: torch.Tensor, xs: list[torch.Tensor], op: object, native: torch.Tensor
) -> str | None:
    """What is wrong with ``got`` as the all-reduce of ``xs`` (None: nothing)."""
    p, dtype = len(xs), got.dtype
    stack = torch.stack([x.double() for x in xs])
    exact = {
        ReduceOp.MAX: lambda: stack.amax(0),
        ReduceOp.MIN: lambda: stack.amin(0),
        ReduceOp.SUM: lambda: stack.sum(0),
        ReduceOp.AVG: lambda: stack.sum(0) / p,
    }[op]()  # type: ignore[index]
    spread = stack.abs().sum(0) / (p if op == ReduceOp.AVG else 1)
    eps, eps32 = torch.finfo(dtype).eps, torch.finfo(torch.float32).eps
    tiny = torch.finfo(dtype).smallest_normal
    exactly = op in (ReduceOp.MAX, ReduceOp.MIN)
    bounds = {
        "exact": (exact, 0 if exactly else eps * exact.abs() + p * eps32 * spread + tiny),
        "dist.all_reduce": (native, 0 if exactly else p * eps * spread + tiny),
    }
    if got.shape != exact.shape or got.dtype != xs[0].dtype:
        return f"{name}: got {tuple(got.shape)} {got.dtype}"
    for what, (want, bound) in bounds.items():
        err = (got.double() - want.double()).abs()
        if err.numel() and bool((err > bound).any()):
            i = int((err - bound).reshape(-1).argmax())
            g, w = got.reshape(-1)[i].item(), want.reshape(-1)[i].item()
            return f"{name} vs {what}: element {i}: got {g}, want {w}"
    return None


def _layout(k: int, results: dict[str, torch.Tensor]) -> list[str]:
    """Every shape x dtype x op on ``node_groups(k)``; results land in ``results`` by case."""
    from labkit.collectives import hierarchical_all_reduce, node_groups
    from labkit.collectives.auto import AllReduceChoice

    rank, p = dist.get_rank(), dist.get_world_size()
    groups = node_groups(k)
    bad = []
    node, local = rank // k, rank % k
    want = ([node * k + i for i in range(k)], [j * k + local for j in range(p // k)])
    got = (dist.get_process_group_ranks(groups.intra), dist.get_process_group_ranks(groups.inter))
    if got != want or (groups.node, groups.local_rank) != (node, local):
        bad.append(f"k={k}: groups {got}, want {want}")
    for case, (shape, dtype, op) in enumerate(_grid(k, p)):
        name = f"[{p // k}x{k} shape={shape} {dtype} {op}]"
        xs = _inputs(shape, dtype, p, case)
        native = xs[rank].clone()
        dist.all_reduce(native, ReduceOp.SUM if op == ReduceOp.AVG else op)
        if op == ReduceOp.AVG:
            native = (native.double() / p).to(dtype)
        # odd cases: tiny ring pieces and the ring across nodes (else recursive doubling)
        extra = {"block": 64, "choice": AllReduceChoice(0)} if case % 2 else {}
        out = hierarchical_all_reduce(xs[rank].clone(), groups, op, **extra)  # type: ignore[arg-type]
        results[name] = out
        if problem := _problem(name, out, xs, op, native):
            bad.append(problem)
    return bad


def _bad_arguments(groups: object) -> list[str]:
    """Each attempt must raise the same ValueError on every rank, and the group keeps working."""
    from labkit.collectives import NodeGroups, hierarchical_all_reduce, node_groups
    from labkit.collectives.common import DEFAULT_POOL

    assert isinstance(groups, NodeGroups)
    DEFAULT_POOL.clear()  # validation starts afresh: nothing trusted from earlier calls
    rank, p = dist.get_rank(), dist.get_world_size()
    last = p - 1  # a rank of the last node: its node-mates agree with it, node 0 does not
    wrong = NodeGroups(groups.intra, groups.inter, nodes=1, ranks_per_node=p)
    attempts = [
        lambda: hierarchical_all_reduce(torch.zeros(10 + (rank == last)), groups),
        lambda: hierarchical_all_reduce(
            torch.zeros(4), groups, ReduceOp.MAX if rank == last else ReduceOp.SUM
        ),
        lambda: hierarchical_all_reduce(torch.zeros(4, dtype=torch.int32), groups),
        lambda: hierarchical_all_reduce(torch.zeros(4), wrong),
        lambda: node_groups(p - 1),
    ]
    errors = value_errors(attempts)
    x = torch.ones(5)
    hierarchical_all_reduce(x, groups)
    errors.append(f"after: {x.tolist()}")
    return errors


def _comm(k: int) -> dict[str, object]:
    """Comm(impl="hierarchical") against Comm(impl="torch"), its byte counters, its checks."""
    from labkit.collectives import BufferPool, Comm, hierarchical_all_reduce, node_groups

    rank, p = dist.get_rank(), dist.get_world_size()
    groups = node_groups(k)
    hier, ref = Comm(None, "hierarchical", nodes=groups), Comm(None, "torch")
    out: dict[str, object] = {}
    numel = 12 * p  # divisible by p and by k: the byte formulas are exact
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    a, b = x.clone(), x.clone()
    hier.all_reduce(a, async_op=True).wait()
    ref.all_reduce(b)
    out["all_reduce_err"] = float((a - b).abs().max())
    out["sent"], out["intra"], out["inter"] = (
        dict(hier.sent),
        dict(hier.sent_intra),
        dict(hier.sent_inter),
    )
    shard, shard_ref = torch.empty(numel // p), torch.empty(numel // p)
    hier.reduce_scatter(shard, x)
    ref.reduce_scatter(shard_ref, x)
    full, full_ref = torch.empty(numel), torch.empty(numel)
    hier.all_gather(full, shard).wait()
    ref.all_gather(full_ref, shard)
    out["rs_err"] = float((shard - shard_ref).abs().max())
    out["ag_equal"] = torch.equal(full, full_ref)
    out["flat_inter"] = dict(hier.sent_inter)
    hier.reset()
    out["after_reset"] = (dict(hier.sent), dict(hier.sent_inter))
    sub = dist.new_group(list(range(p - 1)))
    out["errors"] = value_errors(
        [
            lambda: Comm(None, "hierarchical"),
            lambda: Comm(sub, "hierarchical", nodes=groups) if rank < p - 1 else None,
        ]
    )
    # torch's collectives are looked up at call time: a wrapper put on dist (the software
    # link model does that inside ranks) sees Comm's calls
    original, seen = dist.all_gather_single, []

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(1)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    dist.all_gather_single = spy  # type: ignore[assignment]
    try:
        ref.all_gather(full_ref, shard_ref)
    finally:
        dist.all_gather_single = original
    out["spied"] = len(seen)
    # scratch buffers are reused: repeated 16-bit calls allocate nothing more
    pool, y = BufferPool(), torch.randn(1001).to(torch.bfloat16)
    hierarchical_all_reduce(y, groups, pool=pool)
    first = pool.allocations
    for _ in range(5):
        hierarchical_all_reduce(y, groups, pool=pool)
    out["allocations"] = (first, pool.allocations)
    return out


def _world(world: int) -> dict[str, object]:
    from labkit.collectives import hierarchical_all_reduce, node_groups
    from labkit.collectives.nccl_order import record_p2p

    out: dict[str, object] = {"results": {}}
    log: list[P2PCall] = []
    bad = []
    with record_p2p(log):
        for k in LAYOUTS[world]:
            bad += _layout(k, out["results"])  # type: ignore[arg-type]
    out["bad"], out["log"] = bad, log
    # negative control: forgetting the cross-node phase (an all-reduce inside the node only)
    # is caught by the same comparison
    groups = node_groups(2 if world == 4 else 3)
    xs = _inputs((7,), torch.float32, world, 999)
    intra_only = xs[dist.get_rank()].clone()
    dist.all_reduce(intra_only, group=groups.intra)
    native = xs[dist.get_rank()].clone()
    dist.all_reduce(native)
    out["negative"] = _problem("intra only", intra_only, xs, ReduceOp.SUM, native)
    hierarchical_all_reduce(torch.ones(3), groups)  # the layout's groups work before the checks
    out["errors"] = _bad_arguments(groups)
    out["comm"] = _comm(2 if world == 4 else 3)
    out["traffic"] = _traffic(groups)
    return out


def _traffic(groups: object) -> dict[str, list[P2PCall]]:
    """The messages of one hierarchical (ring across nodes) and one flat-ring all-reduce."""
    from labkit.collectives import NodeGroups, hierarchical_all_reduce, tuned_all_reduce
    from labkit.collectives.auto import AllReduceChoice
    from labkit.collectives.nccl_order import record_p2p

    assert isinstance(groups, NodeGroups)
    x = torch.ones(24 * dist.get_world_size())  # divisible by k, then by n: exact byte counts
    hier: list[P2PCall] = []
    flat: list[P2PCall] = []
    with record_p2p(hier):
        hierarchical_all_reduce(x, groups, check=False, choice=AllReduceChoice(0))
    with record_p2p(flat):
        tuned_all_reduce(x, check=False)
    return {"hier": hier, "flat": flat}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [4, 6])
def test_hierarchical_all_reduce_equals_dist_all_reduce(world: int) -> None:
    results = run_ranks(_world, world, world_size=world, timeout=140)
    for rank, res in enumerate(results):
        assert res["bad"] == [], f"rank {rank}:\n" + "\n".join(res["bad"])  # type: ignore[arg-type]
    _check_errors([res["errors"] for res in results], world)  # type: ignore[misc]
    _check_comm([res["comm"] for res in results], world)  # type: ignore[misc]
    cases = results[0]["results"]
    assert len(cases) == sum(len(_grid(k, world)) for k in LAYOUTS[world])  # type: ignore[arg-type]
    for res in results[1:]:  # every rank holds the bit-identical result
        assert all(torch.equal(cases[c], res["results"][c]) for c in cases)  # type: ignore[index]
    # NCCL-safe: every message of every case, replayed under NCCL's matching rules
    logs = [res["log"] for res in results]
    assert all(len(log) > 100 for log in logs)  # type: ignore[arg-type]
    assert nccl_problems(logs) == []  # type: ignore[arg-type]
    # negative control: the comparison catches an all-reduce that skips the cross-node phase
    assert "vs exact" in str(results[0]["negative"])
    # what crossed the slow link, counted from the recorded messages (2 nodes of k ranks)
    k = 2 if world == 4 else 3
    n, numel = world // k, 24 * world
    for algo, want in (
        ("hier", 2 * (n - 1) / n * numel),
        ("flat", 2 * (world - 1) / world * numel),
    ):
        per_node = [0] * n
        for rank, res in enumerate(results):
            calls = res["traffic"][algo]  # type: ignore[index]
            # check=False: no argument check and no settle (guard.py), only data
            assert not [c for c in calls if c.tag == CONTROL_TAG], algo
            for call in calls:
                if call.kind == "send" and call.peer // k != rank // k:
                    per_node[rank // k] += call.numel
                    if algo == "hier":  # only pieces of this rank's chunk cross nodes
                        assert call.numel <= numel // k
        assert per_node == [want] * n, (algo, per_node)


def _check_errors(errors: list[list[str]], p: int) -> None:
    """The same clear ValueError on every rank, for every bad argument; the group survives."""
    for attempt in zip(*errors):
        assert len(set(attempt)) == 1, attempt
    size, op, dtype, layout, split, after = errors[0]
    sizes = ", ".join(f"rank {r}: {11 if r == p - 1 else 10}" for r in range(p))
    assert f"hierarchical_all_reduce: ranks disagree on numel ({sizes})" in size
    assert "disagree on reduce op" in op
    assert "unsupported dtype torch.int32" in dtype
    assert f"ranks_per_node={p}, nodes=1 and world_size={p}" in layout
    assert f"ranks_per_node={p - 1} must be >= 1 and divide world_size={p}" in split
    assert after == f"after: {[float(p)] * 5}"


def _check_comm(comms: list[dict[str, object]], p: int) -> None:
    """Comm(impl="hierarchical") equals Comm(impl="torch"); its byte counters match the formulas."""
    k = 2 if p == 4 else 3
    n, numel = p // k, 12 * p
    nbytes = 4 * numel  # float32
    for rank, c in enumerate(comms):
        assert c["all_reduce_err"] < 1e-5 and c["rs_err"] < 1e-5 and c["ag_equal"], c
        # sent keeps its meaning: the flat ring's 2(p-1)/p D
        assert c["sent"] == {"all_reduce": 2 * nbytes * (p - 1) // p}
        # inside the node: reduce-scatter + all-gather, 2(k-1)/k D; across: 2(n-1)/n of a chunk
        assert c["intra"] == {"all_reduce": 2 * nbytes * (k - 1) // k}
        assert c["inter"] == {"all_reduce": 2 * (nbytes // k) * (n - 1) // n}
        # flat reduce-scatter/all-gather: only a node's last rank sends to the next node
        flat = (p - 1) * nbytes // p
        if rank % k == k - 1:
            assert c["flat_inter"] == {**c["inter"], "reduce_scatter": flat, "all_gather": flat}  # type: ignore[dict-item]
        else:
            assert c["flat_inter"] == c["inter"]
        assert c["after_reset"] == ({}, {})
        assert 'impl="hierarchical" needs nodes=node_groups(ranks_per_node)' in c["errors"][0]  # type: ignore[index]
        if rank < p - 1:
            assert f"must cover the group, global ranks 0..{p - 1} in order" in c["errors"][1]  # type: ignore[index]
        assert c["spied"] == 1
        first, later = c["allocations"]  # type: ignore[misc]
        assert later == first > 0
    # summed over a node's ranks: what crossed its one uplink, 2(n-1)/n D
    assert sum(comms[r]["inter"]["all_reduce"] for r in range(k)) == 2 * (n - 1) * nbytes // n  # type: ignore[index]


# ---- the cost model, against numbers worked out by hand (no processes) -------------------------


def test_two_level_cost_model_by_hand() -> None:
    intra, inter = cm.AlphaBeta(1e-6, 1e-11), cm.AlphaBeta(1e-4, 1e-9)  # 100 GB/s, 1 GB/s
    d = 8e6  # 8 MB per rank
    # 4 nodes x 2 ranks, one NIC: 2(2-1) a_i + 2(1/2) D b_i + 2(4-1) a_e + 2(3/4) (D/2) b_e * 2
    want = 2e-6 + 8e6 * 1e-11 + 6e-4 + 1.5 * 4e6 * 1e-9 * 2
    assert cm.hierarchical_all_reduce_time(d, 4, 2, intra, inter) == pytest.approx(want)
    assert want == pytest.approx(2e-6 + 8e-5 + 6e-4 + 1.2e-2)
    # flat ring over 8 ranks: 14 steps, each at the slow link: 14 (a_e + D/8 b_e)
    flat = cm.flat_ring_two_level_time(d, 4, 2, intra, inter)
    assert flat == pytest.approx(14 * (1e-4 + 1e6 * 1e-9))
    # one NIC: the bandwidth terms are close (1.5 D vs 1.75 D), the latency 6 vs 14 steps
    assert flat - cm.hierarchical_all_reduce_time(d, 4, 2, intra, inter) == pytest.approx(
        8 * 1e-4 + (1.75 - 1.5) * d * 1e-9 - 2e-6 - 8e-5
    )
    # one NIC per rank: the cross-node bandwidth term shrinks k-fold, for the flat ring too:
    # NCCL's channels each cross on their own NIC (rail-aligned), not one flow per node
    big = 1e12  # bandwidth-bound
    one = cm.hierarchical_all_reduce_time(big, 4, 8, (0.0, 0.0), (0.0, 1e-9))
    rails = cm.hierarchical_all_reduce_time(big, 4, 8, (0.0, 0.0), (0.0, 1e-9), nics_per_node=8)
    assert one == pytest.approx(1.5 * big * 1e-9) and one / rails == pytest.approx(8)
    assert cm.hierarchical_all_reduce_time(big, 4, 8, (0.0, 0.0), (0.0, 1e-9), 4) == (
        pytest.approx(2 * rails)
    )
    assert cm.flat_ring_two_level_time(big, 4, 8, intra, inter, nics_per_node=8) == (
        pytest.approx(cm.flat_ring_two_level_time(big, 4, 8, intra, inter) / 8, rel=1e-4)
    )
    # one node: both are the plain ring on the intra link; one rank per node: the inter ring
    for nodes, k, link in ((1, 8, intra), (8, 1, inter)):
        ring = cm.ring_all_reduce_time(d, 8, *link)
        assert cm.hierarchical_all_reduce_time(d, nodes, k, intra, inter) == pytest.approx(ring)
        assert cm.flat_ring_two_level_time(d, nodes, k, intra, inter) == pytest.approx(ring)
    assert cm.hierarchical_all_reduce_time(d, 1, 1, intra, inter) == 0.0
    with pytest.raises(ValueError, match="ranks_per_node must be >= 1, got 0"):
        cm.hierarchical_all_reduce_time(d, 4, 0, intra, inter)
    with pytest.raises(ValueError, match="nics_per_node must be >= 1, got 0"):
        cm.flat_ring_two_level_time(d, 4, 2, intra, inter, nics_per_node=0)
    assert math.isfinite(cm.hierarchical_all_reduce_time(0, 4, 2, intra, inter))
