"""What 16-bit partials travel as: ``wire="accum"`` (float32, one rounding) or ``"input"``.

One ``run_ranks`` call per world size (3: uneven, recursive doubling folds a rank in; 4: the
2x2 hierarchical layout). Each rank builds every rank's input from a seed, so it knows the
exact (float64) result. Checked, for every from-scratch reduction (tuned and readable ring,
recursive doubling, ``auto.all_reduce``, hierarchical) x float16/bfloat16/float32 x SUM/AVG/MAX:

* the bound ``ring_tuned.py`` states for each mode (``u``: unit roundoff, ``S = sum |x_i|``):
  "accum" ``u |s| + (p-1) u32 S``; "input" ``(p-1) u S`` (first order; AVG one more rounding
  ``u |s|``); the test allows the second-order terms a factor ``1 + p eps``;
* every rank holds the bit-identical all-reduce result; float32 is bit-identical in both modes;
* the bytes: ``Comm.sent`` / ``sent_intra`` / ``sent_inter`` equal the bytes of the messages
  really posted (recorded with their data), and "input" halves the reduce phase for 16-bit
  dtypes (reduce-scatter 1/2, all-reduce 2/3 since its all-gather is 16-bit either way).

Negative controls: the summed error of "input" is larger than that of "accum" (it really
rounds per hop), and the old accounting (every phase at the tensor's element size) does not
match what "accum" posts.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from labkit.collectives.primitives import CONTROL_TAG
from tests.ranks import run_ranks, value_errors

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks cannot import tests/

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX)
WIRES = ("accum", "input")


def _algorithms(p: int) -> dict[str, Callable[..., torch.Tensor]]:
    """Every all-reduce that takes ``wire=``, as ``f(x, op, wire)`` returning ``x`` reduced."""
    from labkit.collectives import hierarchical_all_reduce, node_groups
    from labkit.collectives.auto import AllReduceChoice, all_reduce
    from labkit.collectives.ring import ring_all_reduce
    from labkit.collectives.ring_tuned import tuned_all_reduce
    from labkit.collectives.tree import recursive_doubling_all_reduce

    groups = node_groups(2 if p == 4 else 1)  # 2 nodes x 2, or 3 nodes of one rank
    return {
        "tuned": lambda x, op, w: tuned_all_reduce(x, op, block=64, wire=w),
        "readable": lambda x, op, w: ring_all_reduce(x, op, wire=w),
        "doubling": lambda x, op, w: recursive_doubling_all_reduce(x, op, wire=w),
        "auto": lambda x, op, w: all_reduce(x, op, wire=w),
        "hier": lambda x, op, w: hierarchical_all_reduce(x, groups, op, block=64, wire=w),
        "hier-ring": lambda x, op, w: hierarchical_all_reduce(
            x, groups, op, choice=AllReduceChoice(0), wire=w
        ),
    }


def _bound(xs: list[torch.Tensor], op: object, wire: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact result of reducing ``xs`` with ``op``, and the error bound of ``wire``."""
    p, dtype = len(xs), xs[0].dtype
    stack = torch.stack([x.double() for x in xs])  # (p, *shape)
    if op == ReduceOp.MAX:
        exact = stack.amax(0)
        return exact, torch.zeros_like(exact)
    avg = op == ReduceOp.AVG
    exact = stack.sum(0) / (p if avg else 1)
    spread = stack.abs().sum(0) / (p if avg else 1)
    eps, eps32 = torch.finfo(dtype).eps, torch.finfo(torch.float32).eps
    u, u32, tiny = eps / 2, eps32 / 2, torch.finfo(dtype).smallest_normal
    if wire == "accum" or dtype == torch.float32:
        bound = u * exact.abs() + (p - 1) * u32 * spread
    else:
        bound = (p - 1) * u * spread + (u * exact.abs() if avg else 0)
    return exact, bound * (1 + p * eps) + tiny


def _accuracy(p: int) -> dict[str, Any]:
    rank = dist.get_rank()
    bad: list[str] = []
    results: dict[str, torch.Tensor] = {}
    err = {w: 0.0 for w in WIRES}  # summed |error| of 16-bit SUMs, per wire
    algos = _algorithms(p)
    case = 0
    for shape in [(0,), (p + 1,), (3, 67)]:
        for dtype in DTYPES:
            for op in OPS:
                case += 1
                gens = [torch.Generator().manual_seed(100 * case + r) for r in range(p)]
                xs = [torch.randn(shape, generator=g).to(dtype) for g in gens]
                for algo, fn in algos.items():
                    for wire in WIRES:
                        name = f"{algo} {wire} {tuple(shape)} {dtype} {op}"
                        got = fn(xs[rank].clone(), op, wire)
                        results[name] = got
                        exact, bound = _bound(xs, op, wire)
                        e = (got.double() - exact).abs()
                        if got.dtype != dtype or bool((e > bound).any()):
                            bad.append(f"{name}: error {e.max()} above the bound")
                        if dtype != torch.float32 and op == ReduceOp.SUM:
                            err[wire] += float(e.sum())
                    if dtype == torch.float32:  # nothing to stage: the modes are one algorithm
                        a, b = (results[f"{algo} {w} {tuple(shape)} {dtype} {op}"] for w in WIRES)
                        if not torch.equal(a, b):
                            bad.append(f"{algo} float32 {shape} {op}: the modes differ")
                bad += _rings_bit_equal(xs[rank], op, results, f"{tuple(shape)} {dtype} {op}")
    return {"bad": bad, "results": results, "err": err}


def _rings_bit_equal(x: torch.Tensor, op: object, results: dict, case: str) -> list[str]:
    """The tuned ring changes how messages move, never a bit: its all-reduce and reduce-scatter
    equal the readable ring's in both wire modes (``test_collectives`` covers "accum" only)."""
    from labkit.collectives.common import chunk_sizes
    from labkit.collectives.ring import ring_reduce_scatter
    from labkit.collectives.ring_tuned import tuned_reduce_scatter

    bad = []
    size = chunk_sizes(x.numel(), dist.get_world_size())[dist.get_rank()]
    for wire in WIRES:
        if not torch.equal(results[f"tuned {wire} {case}"], results[f"readable {wire} {case}"]):
            bad.append(f"tuned {wire} {case}: all-reduce differs from the readable ring")
        shards = [torch.empty(size, dtype=x.dtype) for _ in range(2)]
        tuned_reduce_scatter(shards[0], x, op, block=64, wire=wire)
        ring_reduce_scatter(shards[1], x, op, wire=wire)
        if not torch.equal(*shards):
            bad.append(f"tuned {wire} {case}: reduce-scatter differs from the readable ring")
    return bad


def _posted(log: list[Any], k: int | None = None) -> tuple[int, int]:
    """Bytes this rank posted (sends, from their recorded data): (to its node, to others)."""
    rank, intra, inter = dist.get_rank(), 0, 0
    for call in log:
        if call.kind == "send" and call.tag != CONTROL_TAG:  # data, not a check or a settle
            nbytes = call.data.numel() * call.data.element_size()
            if k is not None and call.peer // k != rank // k:
                inter += nbytes
            else:
                intra += nbytes
    return intra, inter


def _bytes(p: int) -> dict[str, Any]:
    """Per (impl, dtype, wire, op): bytes counted by Comm and bytes posted (intra, inter)."""
    from labkit.collectives import Comm, node_groups
    from labkit.collectives.nccl_order import record_p2p

    groups = node_groups(2) if p == 4 else None
    impls = ["ring", "hierarchical"] if groups else ["ring"]
    numel = 12 << 16  # divisible by p and by k; 1.5 MB in 16 bits: the ring, not doubling
    out: dict[str, Any] = {}
    for impl in impls:
        for dtype in DTYPES:
            for wire in WIRES:
                comm = Comm(None, impl, nodes=groups, wire=wire)
                x = torch.randn(numel).to(dtype)
                shard = torch.empty(numel // p, dtype=dtype)
                for op, call in (
                    ("reduce_scatter", lambda c=comm, s=shard, t=x: c.reduce_scatter(s, t)),
                    ("all_reduce", lambda c=comm, t=x: c.all_reduce(t.clone())),
                ):
                    log: list[Any] = []
                    with record_p2p(log, copy_sends=True):
                        call()
                    counted = (comm.sent[op], comm.sent_intra[op], comm.sent_inter[op])
                    out[f"{impl} {dtype} {wire} {op}"] = (
                        counted,
                        _posted(log, 2 if groups else None),
                    )
    return out


def _errors_and_pool(p: int) -> dict[str, Any]:
    """Bad ``wire`` values: a clear ValueError on every rank; no allocation per call."""
    from labkit.collectives import BufferPool, Comm, hierarchical_all_reduce, node_groups
    from labkit.collectives.ring_tuned import tuned_all_reduce, tuned_reduce_scatter

    rank = dist.get_rank()
    last = "input" if rank == p - 1 else "accum"
    attempts = [
        lambda: Comm(None, "ring", wire="fp16"),
        lambda: tuned_reduce_scatter(
            torch.zeros(1), torch.zeros(p), wire="bf16", pool=BufferPool()
        ),
        lambda: tuned_reduce_scatter(
            torch.zeros(1, dtype=torch.bfloat16),
            torch.zeros(p, dtype=torch.bfloat16),
            wire=last,
            pool=BufferPool(),
        ),
    ]
    errors = value_errors(attempts)
    groups = node_groups(2 if p == 4 else 1)
    pool, y = BufferPool(), torch.randn(1001).to(torch.bfloat16)

    def both() -> None:  # the flat ring (its buffers on every rank) and the two levels
        tuned_all_reduce(y, pool=pool, wire="input")
        hierarchical_all_reduce(y, groups, pool=pool, wire="input")

    both()
    first = pool.allocations
    for _ in range(3):
        both()
    return {"errors": errors, "allocations": (first, pool.allocations), "after": y.sum().item()}


def _world(p: int) -> dict[str, Any]:
    return {**_accuracy(p), "bytes": _bytes(p), **_errors_and_pool(p)}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [3, 4])
def test_wire16(world: int) -> None:
    results = run_ranks(_world, world, world_size=world, timeout=140)
    for rank, res in enumerate(results):
        assert res["bad"] == [], f"rank {rank}:\n" + "\n".join(res["bad"])
    cases = results[0]["results"]
    for res in results[1:]:  # every rank holds the bit-identical all-reduce result
        assert all(torch.equal(cases[c], res["results"][c]) for c in cases)
    # negative control: "input" really rounds at every hop (else its error would equal accum's)
    err = results[0]["err"]
    assert err["input"] > err["accum"] > 0, err
    _check_bytes([res["bytes"] for res in results], world)
    for res in results:
        fp16, bf16, disagree = res["errors"]
        assert "Comm: wire must be one of ('accum', 'input'), got 'fp16'" in fp16
        assert "ring_reduce_scatter: wire must be one of ('accum', 'input'), got 'bf16'" in bf16
        assert "ring_reduce_scatter: ranks disagree on wire (index in accum, input)" in disagree
        first, later = res["allocations"]
        assert later == first > 0
        assert res["after"] != 0.0  # the group still works after the errors


def _check_bytes(per_rank: list[dict[str, Any]], p: int) -> None:
    numel = 12 << 16
    for rank, got in enumerate(per_rank):
        for name, (counted, posted) in got.items():
            impl, dtype_name, wire, op = name.split()
            sent, intra, inter = counted
            # what Comm counts is what this rank posted, per link class and (for a flat ring:
            # ``sent`` keeps the flat ring's meaning under "hierarchical") in total
            if p == 4:
                assert (intra, inter) == posted, (rank, name, counted, posted)
            if not (impl == "hierarchical" and op == "all_reduce"):
                assert sent == sum(posted), (rank, name, counted, posted)
            if dtype_name == "torch.float32":
                assert got[name.replace(wire, "input")] == got[name.replace(wire, "accum")]
                continue
            if wire == "accum":
                # negative control: the old count (every phase at 2 bytes) is not what travels
                phases = 2 if op == "all_reduce" else 1
                assert sent != phases * 2 * numel * (p - 1) // p
                continue
            accum = got[name.replace("input", "accum")][0]
            ratio = sent / accum[0]
            assert ratio == pytest.approx(0.5 if op == "reduce_scatter" else 2 / 3), name
            if impl == "hierarchical" and op == "all_reduce":  # phase 2 halves: it is all partials
                assert 2 * inter == accum[2] > 0, name
