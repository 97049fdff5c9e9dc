"""The spec of labkit.collectives: equal to torch.distributed's collectives, close to the exact sum.

One launch per world size runs every (algorithm, shape, dtype, op) case on the whole world
and on a subgroup, and returns the list of mismatches; the test asserts that list is empty.
Each rank builds every rank's input from a seed, so it also knows the exact (float64) result.
The same launch records every point-to-point call each rank posts (``nccl_order.record_p2p``)
and the test replays them under NCCL's rules: gloo tolerates orders that hang on GPUs, so
equality alone cannot prove the collectives NCCL-safe.

Tolerances (``eps`` = machine epsilon of the dtype, ``S`` = sum of |x_i| over ranks):
* ours vs the exact result: ``eps * |exact| + p * eps32 * S`` (+ the dtype's smallest
  subnormal): float32 partials, then one rounding to the dtype;
* ours vs ``dist.all_reduce``: ``p * eps * S``, the error bound of a p-term sum rounded at
  every hop (what a native 16-bit ring does); MAX must be exact.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from labkit.collectives import cost_model as cm
from labkit.collectives.common import chunk_offsets, chunk_sizes
from labkit.collectives.nccl_order import P2PCall, nccl_problems
from tests.ranks import run_ranks, value_errors

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks cannot import tests/

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX)


def _inputs(
    shape: tuple[int, ...], dtype: torch.dtype, world: int, case: int
) -> list[torch.Tensor]:
    """Every rank's input for one case, identical on all ranks (seeded by rank and case)."""
    return [
        torch.randn(shape, generator=torch.Generator().manual_seed(1000 * case + r)).to(dtype)
        for r in range(world)
    ]


def _exact(xs: list[torch.Tensor], op: object) -> torch.Tensor:
    stack = torch.stack([x.double() for x in xs])
    if op == ReduceOp.MAX:
        return stack.amax(0)
    total = stack.sum(0)
    return total / len(xs) if op == ReduceOp.AVG else total


def _close(name: str, got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> str | None:
    err = (got.double() - ref.double()).abs()
    if got.shape != ref.shape:
        return f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    if err.numel() and bool((err > bound).any()):
        i = int((err - bound).reshape(-1).argmax())
        g, r, b = (t.reshape(-1)[i].item() for t in (got, ref, bound))
        return f"{name}: element {i}: got {g}, want {r} (bound {b:.3g})"
    return None


def _cases(group: dist.ProcessGroup | None, tag: str) -> list[str]:
    """Every algorithm x shape x dtype x op on ``group``; returns mismatch descriptions."""
    from labkit.collectives import (
        BufferPool,
        broadcast,
        naive_all_reduce,
        recursive_doubling_all_reduce,
        ring_all_gather,
        ring_all_reduce,
        ring_reduce_scatter,
        tuned_all_gather,
        tuned_all_reduce,
        tuned_reduce_scatter,
    )
    from labkit.collectives.auto import AllReduceChoice, all_reduce

    rank, p = dist.get_rank(group), dist.get_world_size(group)
    bad: list[str] = []
    shapes = [(), (0,), (p - 1,), (p + 1,), (3, 67), (4 * p,)]  # 0-d, empty, < p, uneven, divisible
    case = 0
    for shape in shapes:
        n = math.prod(shape)
        size, off = chunk_sizes(n, p), chunk_offsets(n, p)
        for dtype in DTYPES:
            eps, eps32 = torch.finfo(dtype).eps, torch.finfo(torch.float32).eps
            for op in OPS:
                case += 1
                name = f"[{tag} p={p} shape={shape} {dtype} {op}]"
                xs = _inputs(shape, dtype, p, case)
                exact = _exact(xs, op)
                spread = torch.stack([x.double().abs() for x in xs]).sum(0)
                if op == ReduceOp.AVG:
                    spread = spread / p
                tiny = torch.finfo(dtype).smallest_normal * 2 ** -(torch.finfo(dtype).bits // 2)
                to_exact = eps * exact.abs() + p * eps32 * spread + tiny
                to_native = p * eps * spread + tiny
                if op == ReduceOp.MAX:
                    to_exact, to_native = torch.zeros_like(exact), torch.zeros_like(exact)
                native = xs[rank].clone()
                dist.all_reduce(native, ReduceOp.SUM if op == ReduceOp.AVG else op, group=group)
                if op == ReduceOp.AVG:
                    native = (native.float() / p).to(dtype)
                # block=64 bytes: the tuned ring cuts the larger chunks into several messages (its
                # pipelined path); auto with small_bytes=0 takes the ring, by default rec. doubling
                algos = {
                    "ring_all_reduce": lambda t, op: ring_all_reduce(t, op, group),
                    "tuned_all_reduce": lambda t, op: tuned_all_reduce(t, op, group),
                    "tuned_all_reduce(block=64)": lambda t, op: tuned_all_reduce(
                        t, op, group, block=64
                    ),
                    "auto all_reduce": lambda t, op: all_reduce(t, op, group),
                    "auto all_reduce(ring)": lambda t, op: all_reduce(
                        t, op, group, choice=AllReduceChoice(0)
                    ),
                    "naive_all_reduce": lambda t, op: naive_all_reduce(t, op, group),
                    "recursive_doubling_all_reduce": lambda t, op: recursive_doubling_all_reduce(
                        t, op, group
                    ),
                }
                readable = None
                for algo_name, algo in algos.items():
                    got = algo(xs[rank].clone(), op)
                    if readable is None:
                        readable = got
                    elif algo_name.startswith("tuned") and not torch.equal(got, readable):
                        bad.append(f"{name} {algo_name} differs from the readable ring_all_reduce")
                    for problem in (
                        _close(f"{name} {algo_name} vs exact", got, exact, to_exact),
                        _close(f"{name} {algo_name} vs dist.all_reduce", got, native, to_native),
                    ):
                        if problem:
                            bad.append(problem)
                    everyone = [torch.empty_like(got) for _ in range(p)]
                    dist.all_gather(everyone, got.contiguous(), group=group)
                    if not all(torch.equal(e, got) for e in everyone):
                        bad.append(f"{name} {algo_name}: ranks hold different results")
                # reduce-scatter: this rank's chunk of the flat result
                shard = torch.empty(size[rank], dtype=dtype)
                tuned_reduce_scatter(shard, xs[rank], op, group, block=64 if case % 2 else 1 << 20)
                readable_shard = ring_reduce_scatter(
                    torch.empty(size[rank], dtype=dtype), xs[rank], op, group
                )
                if not torch.equal(shard, readable_shard):
                    bad.append(
                        f"{name} tuned_reduce_scatter differs from the readable ring_reduce_scatter"
                    )
                lo, hi = off[rank], off[rank + 1]

                def flat(t: torch.Tensor, lo: int = lo, hi: int = hi) -> torch.Tensor:
                    return t.reshape(-1)[lo:hi]

                for problem in (
                    _close(
                        f"{name} ring_reduce_scatter vs exact", shard, flat(exact), flat(to_exact)
                    ),
                    _close(
                        f"{name} ring_reduce_scatter vs all_reduce",
                        shard,
                        flat(native),
                        flat(to_native),
                    ),
                ):
                    if problem:
                        bad.append(problem)
                if n % p == 0 and n > 0 and op != ReduceOp.AVG:
                    ref = torch.empty(n // p, dtype=dtype)
                    dist.reduce_scatter_tensor(ref, xs[rank].reshape(-1).clone(), op, group=group)
                    if problem := _close(
                        f"{name} ring_reduce_scatter vs dist.reduce_scatter_tensor",
                        shard,
                        ref,
                        flat(to_native),
                    ):
                        bad.append(problem)
                if op != ReduceOp.SUM:
                    continue
                # all-gather: every rank's chunk lands in place, bit for bit
                whole = torch.full(shape, float("nan"), dtype=dtype)
                tuned_all_gather(
                    whole,
                    xs[rank].reshape(-1)[lo:hi].clone(),
                    group,
                    block=64 if case % 2 else 1 << 20,
                )
                want = torch.cat(
                    [xs[r].reshape(-1)[off[r] : off[r + 1]] for r in range(p)]
                ).reshape(shape)
                if not torch.equal(whole, want):
                    bad.append(f"{name} ring_all_gather: differs from the concatenated shards")
                readable_whole = torch.full(shape, float("nan"), dtype=dtype)
                ring_all_gather(readable_whole, xs[rank].reshape(-1)[lo:hi].clone(), group)
                if not torch.equal(readable_whole, want):
                    bad.append(
                        f"{name} readable ring_all_gather: differs from the concatenated shards"
                    )
                if n % p == 0 and n > 0:
                    ref = torch.empty(n, dtype=dtype)
                    dist.all_gather_into_tensor(
                        ref, xs[rank].reshape(-1)[lo:hi].clone(), group=group
                    )
                    if not torch.equal(whole.reshape(-1), ref):
                        bad.append(
                            f"{name} ring_all_gather: differs from dist.all_gather_into_tensor"
                        )
                # broadcast from the last rank of the group
                got = xs[rank].clone()
                broadcast(got, src=p - 1, group=group)
                if not torch.equal(got, xs[p - 1]):
                    bad.append(f"{name} broadcast(src={p - 1}) differs from rank {p - 1}'s tensor")
    # buffers are reused: a second and tenth call of the same size allocate nothing
    pool = BufferPool()
    x = torch.randn(10_001)
    tuned_all_reduce(x, group=group, pool=pool)
    first = pool.allocations
    for _ in range(9):
        tuned_all_reduce(x, group=group, pool=pool)
    tuned_reduce_scatter(torch.empty(chunk_sizes(10_001, p)[rank]), x, group=group, pool=pool)
    if pool.allocations != first:
        bad.append(
            f"[{tag}] BufferPool grew from {first} to {pool.allocations} allocations on repeated "
            "calls"
        )
    return bad


def _irecv_then_isend(peer: int) -> None:
    """The pattern NCCL deadlocks on (the old pairwise exchange): gloo lets it through."""
    send, recv = torch.ones(3), torch.empty(3)
    works = [dist.irecv(recv, peer), dist.isend(send, peer)]
    for work in works:
        work.wait()


def _posts(fn: Callable[[], object]) -> list[P2PCall]:
    from labkit.collectives.nccl_order import record_p2p

    log: list[P2PCall] = []
    with record_p2p(log):
        fn()
    return log


def _cached_validation(world: int) -> dict[str, object]:
    """Messages posted by a first call (validation + data) and by a repeat (data only)."""
    from labkit.collectives import BufferPool, recursive_doubling_all_reduce
    from labkit.collectives.auto import AllReduceChoice, all_reduce

    pool = BufferPool()
    x = torch.ones(8)
    first = _posts(lambda: recursive_doubling_all_reduce(x, pool=pool))
    again = _posts(lambda: recursive_doubling_all_reduce(x, pool=pool))
    other_size = _posts(lambda: recursive_doubling_all_reduce(torch.ones(9), pool=pool))
    # labkit's all-reduce: one full-size swap per step below small_bytes, chunk-size ring above
    small = _posts(lambda: all_reduce(torch.ones(64), pool=pool, check=False))
    large = _posts(
        lambda: all_reduce(torch.ones(64), pool=pool, check=False, choice=AllReduceChoice(64))
    )
    return {
        "first": len(first),
        "again": len(again),
        "other": len(other_size),
        "small": sorted({c.numel for c in small}),
        "large": sorted({c.numel for c in large}),
    }


def _world(world: int) -> dict[str, object]:
    from labkit.collectives.nccl_order import record_p2p

    out: dict[str, object] = {}
    log: list[P2PCall] = []
    with record_p2p(log):
        out["whole"] = _cases(None, "world")
        # a subgroup that skips rank 0, so group ranks and global ranks differ
        members = [0, 2] if world == 3 else list(range(1, world))
        sub = dist.new_group(members)
        if dist.get_rank() in members:
            out["sub"] = _cases(sub, f"subgroup {members}")
    out["log"] = log
    if dist.get_rank() < 2:  # the negative control, on ranks 0 and 1
        out["bad_log"] = _posts(lambda: _irecv_then_isend(1 - dist.get_rank()))
    dist.barrier()
    if world == 4:
        from labkit.measure.collectives import traced_ring

        out["trace"] = traced_ring()
    if world == 2:
        out["cache"] = _cached_validation(world)
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_equal_to_torch_distributed(world: int) -> None:
    results = run_ranks(_world, world, world_size=world, timeout=170)
    for rank, res in enumerate(results):
        assert res["whole"] == [], f"rank {rank}:\n" + "\n".join(res["whole"])  # type: ignore[arg-type]
        if "sub" in res:
            assert res["sub"] == [], f"rank {rank}:\n" + "\n".join(res["sub"])  # type: ignore[arg-type]
    assert sum("sub" in res for res in results) == (2 if world == 3 else world - 1)
    # NCCL-safe: every call of every collective above, on the world and on the subgroup
    logs = [res["log"] for res in results]
    assert all(len(log) > 100 for log in logs)  # type: ignore[arg-type]
    assert nccl_problems(logs) == []  # type: ignore[arg-type]
    # negative control: the old irecv-then-isend exchange passes under gloo but is rejected here
    bad = [results[0]["bad_log"], results[1]["bad_log"]] + [[] for _ in range(world - 2)]
    problems = nccl_problems(bad)  # type: ignore[arg-type]
    assert any("ungrouped irecv from rank 1" in p for p in problems), problems
    assert any("ranks 0 and 1 deadlock under NCCL" in p for p in problems), problems
    if world == 2:  # validation is paid once per (collective, size, op, dtype, group); the
        # settle (guard.py: did any rank fail half-way?) once per call with check=True, 1
        # element each way; check=False (small, large) neither checks nor settles
        cache = results[0]["cache"]
        assert cache["first"] == 6 and cache["again"] == 4 and cache["other"] == 6, cache  # type: ignore[index]
        assert cache["small"] == [64] and cache["large"] == [32], cache  # type: ignore[index]
    if world == 4:  # the ring's invariant, read from a real run
        for rank, res in enumerate(results):
            trace = res["trace"]
            assert len(trace) == 2 * (world - 1)  # type: ignore[arg-type]
            for phase, step, chunk, mask in trace:  # type: ignore[union-attr]
                if phase == "reduce-scatter":
                    # after step s, rank r holds chunk r-s-2 summed over ranks r, r-1, ..., r-s-1
                    assert chunk == (rank - step - 2) % world
                    assert mask == sum(2 ** ((rank - k) % world) for k in range(step + 2))
                else:  # all-gather forwards finished chunks: everyone's contribution
                    assert chunk == (rank - step - 1) % world and mask == 2**world - 1


def _bad_inputs() -> list[str]:
    from labkit.collectives import (
        naive_all_reduce,
        ring_all_gather,
        ring_all_reduce,
        ring_reduce_scatter,
    )
    from labkit.collectives.common import DEFAULT_POOL

    DEFAULT_POOL.clear()  # validation starts afresh: no combination is trusted from earlier calls
    rank = dist.get_rank()
    errors: list[str] = []
    attempts = [
        lambda: ring_all_reduce(torch.zeros(10 + 2 * rank)),  # size differs across ranks
        lambda: ring_all_reduce(torch.zeros(4), ReduceOp.PRODUCT),  # unsupported everywhere
        lambda: ring_all_reduce(
            torch.zeros(4), ReduceOp.MAX if rank else ReduceOp.SUM
        ),  # op differs
        lambda: ring_all_reduce(torch.zeros(4, dtype=torch.float16 if rank else torch.float32)),
        lambda: ring_all_reduce(torch.zeros(4, dtype=torch.int32)),
        lambda: ring_reduce_scatter(
            torch.zeros(2), torch.zeros(5)
        ),  # chunks are [3, 2]: rank 0's is wrong
        lambda: ring_all_gather(torch.zeros(5 + rank), torch.zeros(3)),  # output size differs
        lambda: naive_all_reduce(torch.zeros(4), root=7),
    ]
    errors += value_errors(attempts)
    x = torch.ones(5)  # the group still works after all that
    ring_all_reduce(x)
    errors.append(f"after: {x.tolist()}")
    return errors


@pytest.mark.timeout(60)
def test_bad_inputs_give_clear_errors_on_every_rank_not_hangs() -> None:
    r0, r1 = run_ranks(_bad_inputs, world_size=2, timeout=45)
    assert "disagree on numel (rank 0: 10, rank 1: 12)" in r0[0] and r0[0] == r1[0]
    assert "unsupported reduce op PRODUCT" in r0[1] and r0[1] == r1[1]
    assert "disagree on reduce op" in r0[2] and r0[2] == r1[2]
    assert "disagree on dtype" in r0[3] and r0[3] == r1[3]
    assert "unsupported dtype torch.int32" in r0[4] and r0[4] == r1[4]
    assert r0[5] == "ring_reduce_scatter: output_shard must have 3 elements on this rank, got 2"
    assert "rank 0 rejected its arguments" in r1[5]
    assert "disagree on numel of output_full (rank 0: 5, rank 1: 6)" in r0[6] and r0[6] == r1[6]
    assert "root must be a rank of the group (0..1), got 7" in r0[7] and r0[7] == r1[7]
    assert r0[-1] == r1[-1] == "after: [2.0, 2.0, 2.0, 2.0, 2.0]"


# ---- the cost model, against numbers worked out by hand --------------------------------------


def test_alpha_beta_formulas_match_hand_computed_values() -> None:
    a, b, d = 1e-5, 1e-9, 1e6  # 10 us, 1 GB/s, 1 MB
    assert cm.ring_all_reduce_time(d, 4, a, b) == pytest.approx(
        6 * a + 1.5e-3
    )  # 2*3 steps, 2*3/4 MB
    assert cm.naive_all_reduce_time(d, 4, a, b) == pytest.approx(6 * (a + 1e-3))
    assert cm.ring_reduce_scatter_time(d, 4, a, b) == pytest.approx(3 * a + 0.75e-3)
    assert cm.ring_all_gather_time(d, 4, a, b) == cm.ring_reduce_scatter_time(d, 4, a, b)
    assert [cm.recursive_doubling_steps(p) for p in (1, 2, 3, 4, 5, 8, 1024)] == [
        0,
        1,
        3,
        2,
        4,
        3,
        10,
    ]
    assert cm.recursive_doubling_time(d, 8, a, b) == pytest.approx(3 * (a + 1e-3))
    assert cm.binomial_broadcast_time(d, 5, a, b) == pytest.approx(3 * (a + 1e-3))
    assert cm.ring_all_reduce_time(d, 1, a, b) == 0.0
    # large messages: naive is p times slower than the ring; tiny ones: the ring pays 2(p-1) alphas
    assert cm.naive_all_reduce_time(1e12, 8, a, b) / cm.ring_all_reduce_time(
        1e12, 8, a, b
    ) == pytest.approx(8, rel=1e-6)
    assert cm.ring_all_reduce_time(0, 1024, a, b) == pytest.approx(2046 * a)
    # ring = rd at D = (6 - 2) a / ((2 - 1.5) b) = 8 a / b for p = 4; p = 2 never crosses
    assert cm.crossover_bytes(4, a, b) == pytest.approx(8 * a / b)
    x = cm.crossover_bytes(4, a, b)
    assert cm.ring_all_reduce_time(x, 4, a, b) == pytest.approx(
        cm.recursive_doubling_time(x, 4, a, b)
    )
    assert cm.crossover_bytes(2, a, b) == math.inf
    assert (
        cm.busbw_factor("all_reduce", 4),
        cm.busbw_factor("reduce_scatter", 4),
        cm.busbw_factor("all_gather", 2),
    ) == (1.5, 0.75, 0.5)
    with pytest.raises(ValueError, match="unknown collective 'alltoall'"):
        cm.busbw_factor("alltoall", 4)
    with pytest.raises(ValueError, match="p must be >= 1, got 0"):
        cm.ring_all_reduce_time(d, 0, a, b)


def test_fit_recovers_alpha_and_beta() -> None:
    sizes = [4096 * 4**k for k in range(9)]
    times = [80e-6 + s / 1.5e9 for s in sizes]
    fit = cm.fit_alpha_beta(sizes, times)
    assert fit.alpha == pytest.approx(80e-6, rel=1e-6) and fit.bandwidth == pytest.approx(
        1.5e9, rel=1e-6
    )
    p = 4  # a ring all-reduce's times: the fit must give the link's alpha and beta back
    ring = [cm.ring_all_reduce_time(s, p, 50e-6, 1e-9) for s in sizes]
    fit = cm.fit_alpha_beta(sizes, ring, steps=2 * (p - 1), bytes_factor=2 * (p - 1) / p)
    assert fit.alpha == pytest.approx(50e-6, rel=1e-6) and fit.beta == pytest.approx(1e-9, rel=1e-6)
    with pytest.raises(ValueError, match=">= 2 points"):
        cm.fit_alpha_beta([1.0], [1.0])


def test_chunks_split_like_tensor_split() -> None:
    for n, p in [(10, 4), (2, 4), (0, 3), (12, 3), (1, 1)]:
        want = [len(c) for c in torch.arange(n).tensor_split(p)]
        assert chunk_sizes(n, p) == want
        assert chunk_offsets(n, p)[-1] == n


@pytest.mark.timeout(90)
def test_bench_records_follow_nccl_tests_definitions() -> None:
    from labkit.measure.collectives import format_table, run_bench

    records = run_bench(2, sizes=[4096, 65536], repeats=2, warmup=1, timeout=60)
    assert {(r.op, r.impl) for r in records} == {
        (op, impl)
        for op in ("all_reduce", "reduce_scatter", "all_gather")
        for impl in ("ours", "torch")
    }
    for r in records:
        assert r.nbytes in (4096, 65536) and r.time_s > 0
        assert r.algbw == pytest.approx(r.nbytes / r.time_s)
        assert r.busbw == pytest.approx(r.algbw * cm.busbw_factor(r.op, 2))
    assert "ours/torch" in format_table(records)


# ---- the exercise check: passes a correct ring, explains a wrong one ---------------------------


def _off_by_one_reduce_scatter(
    output_shard: torch.Tensor, input_full: torch.Tensor, group: object = None
) -> None:
    """A classic learner bug: adds its own chunk r-s-1 (the one it sent) instead of r-s-2."""
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = input_full.tensor_split(p)
    partial = chunks[(rank - 1) % p].clone()
    for step in range(p - 1):
        c = (rank - step - 1) % p  # should be (rank - step - 2) % p
        incoming = torch.empty_like(chunks[c])
        ops = [
            dist.P2POp(dist.isend, partial, (rank + 1) % p),
            dist.P2POp(dist.irecv, incoming, (rank - 1) % p),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        partial = incoming + chunks[c]
    output_shard.copy_(partial)


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("checks_on_warm_ranks")
def test_exercise_check_passes_labkit_ring_and_explains_a_wrong_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from labkit.checks.collectives import check_ring
    from labkit.checks.core import CheckFailed
    from labkit.collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter

    check_ring(ring_reduce_scatter, ring_all_gather, ring_all_reduce)
    assert "PASSED" in capsys.readouterr().out
    with pytest.raises(CheckFailed) as failure:
        check_ring(_off_by_one_reduce_scatter, ring_all_gather)
    message = str(failure.value)
    assert (
        "reduce_scatter, 6 elements, rank 0's shard (chunk 0)" in message
    )  # which rank, which chunk
    assert "reduce-scatter step 1: rank 0 sent to rank 1" in message  # which step
    assert "<-- differs" in message and "chunks got mixed" in message


def _native_all_reduce_then_slice(
    output_shard: torch.Tensor, input_full: torch.Tensor, group: object = None
) -> None:
    """Numerically right, but no ring: torch's all-reduce, then keep my chunk."""
    total = input_full.clone()
    dist.all_reduce(total)
    output_shard.copy_(total.tensor_split(dist.get_world_size())[dist.get_rank()])


def _everyone_sends_everything(
    output_shard: torch.Tensor, input_full: torch.Tensor, group: object = None
) -> None:
    """Numerically right and point-to-point only, but not a ring: whole tensors to every rank."""
    rank, p = dist.get_rank(), dist.get_world_size()
    incoming = [torch.empty_like(input_full) for _ in range(p)]
    ops = [dist.P2POp(dist.isend, input_full, r) for r in range(p) if r != rank]
    ops += [dist.P2POp(dist.irecv, incoming[r], r) for r in range(p) if r != rank]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    incoming[rank] = input_full
    output_shard.copy_(torch.stack(incoming).sum(0).tensor_split(p)[rank])


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("checks_on_warm_ranks")
def test_exercise_check_rejects_native_collectives_and_non_ring_traffic() -> None:
    from labkit.checks.collectives import check_ring
    from labkit.checks.core import CheckFailed
    from labkit.collectives import ring_all_gather

    with pytest.raises(CheckFailed) as native:
        check_ring(_native_all_reduce_then_slice, ring_all_gather)
    assert "dist.all_reduce is switched off during this check" in str(native.value)
    assert "point-to-point" in str(native.value)
    with pytest.raises(CheckFailed) as flood:
        check_ring(_everyone_sends_everything, ring_all_gather)
    message = str(flood.value)
    assert (
        "reduce-scatter of 6 elements on 3 ranks: rank 0 sent 2 messages of [6, 6] elements"
        in message
    )
    assert "world_size - 1 = 2 messages per phase, each one chunk ([2, 2, 2] elements)" in message


# ---- the NCCL order checker on hand-written logs (no processes) --------------------------------


def _call(
    kind: str, peer: int, batch: int | None = None, blocking: bool = False, done: int | None = None
) -> P2PCall:
    return P2PCall(kind, peer, 4, batch, blocking, done)


def test_nccl_order_checker_on_hand_written_logs() -> None:
    # batched exchange on both ranks: safe
    assert (
        nccl_problems(
            [[_call("send", 1, 0), _call("recv", 1, 0)], [_call("recv", 0, 0), _call("send", 0, 0)]]
        )
        == []
    )
    # blocking send-then-recv against recv-then-send (naive, recursive doubling's fold): safe
    ordered = [
        [_call("send", 1, blocking=True, done=1), _call("recv", 1, blocking=True, done=2)],
        [_call("recv", 0, blocking=True, done=1), _call("send", 0, blocking=True, done=2)],
    ]
    assert nccl_problems(ordered) == []
    # both ranks block in send first: deadlock
    both_send = [
        [_call("send", 1, blocking=True, done=1), _call("recv", 1, blocking=True, done=2)]
    ] * 2
    both_send[1] = [
        _call("send", 0, blocking=True, done=1),
        _call("recv", 0, blocking=True, done=2),
    ]
    assert any("deadlock" in p for p in nccl_problems(both_send))
    # grouped on one side, ungrouped on the other: flagged
    mixed = [[_call("send", 1, 0)], [_call("recv", 0, blocking=True, done=1)]]
    assert any("grouped against ungrouped" in p for p in nccl_problems(mixed))
    # a message nobody receives
    assert any("deadlock" in p for p in nccl_problems([[_call("send", 1, 0)], []]))


def _halving_doubling_cases() -> dict[str, object]:
    """Rabenseifner's all-reduce against torch's on sizes not divisible by p, ops, dtypes."""
    from labkit.collectives import tree
    from labkit.collectives.nccl_order import record_p2p
    from labkit.collectives.pool import BufferPool

    rank, world = dist.get_rank(), dist.get_world_size()
    bad: list[str] = []
    log: list[P2PCall] = []
    with record_p2p(log):
        for case, (n, dtype, op) in enumerate(
            [(0, torch.float32, ReduceOp.SUM), (1, torch.float32, ReduceOp.SUM)]
            + [(n, torch.float32, ReduceOp.SUM) for n in (2, 5, 7, 13, 1001)]
            + [(11, torch.float32, ReduceOp.MAX), (9, torch.float32, ReduceOp.AVG)]
            + [(10, torch.bfloat16, ReduceOp.SUM)]
        ):
            # integer-valued floats: every summation order gives the same bits
            x = torch.randint(-50, 50, (n,), generator=torch.Generator().manual_seed(case + rank))
            ours, ref = x.to(dtype), x.to(dtype)
            tree.halving_doubling_all_reduce(ours, op)
            dist.all_reduce(ref, op)
            if not torch.equal(ours, ref):
                bad.append(f"n={n} {dtype} {op}: {ours.tolist()} != {ref.tolist()}")
        # recursive doubling on a vector of megabytes, an odd count of elements
        n = 3 * (1 << 18) + 7
        for case, (dtype, op) in enumerate(
            [(torch.float32, ReduceOp.SUM), (torch.bfloat16, ReduceOp.SUM),
             (torch.float32, ReduceOp.MAX)]
        ):  # fmt: skip
            x = torch.randint(-50, 50, (n,), generator=torch.Generator().manual_seed(case + rank))
            ours, ref = x.to(dtype), x.to(dtype)
            tree.recursive_doubling_all_reduce(ours, op)
            dist.all_reduce(ref, op)
            if not torch.equal(ours, ref):
                bad.append(f"recursive doubling n={n} {dtype} {op}: differs from torch's")
    # negative control: the halving alone (no all-gather back) is a reduce-scatter, not a result
    x = torch.arange(13.0) + rank
    ref = x.clone()
    dist.all_reduce(ref)
    if world & (world - 1) == 0:  # power of two: no fold-in, so the halving runs on every rank
        tree._halve_(x, ReduceOp.SUM, None, BufferPool())
    return {"bad": bad, "log": log, "halved_only_equal": bool(torch.equal(x, ref))}


@pytest.mark.timeout(120)
def test_halving_doubling_equals_torch_all_reduce_and_is_nccl_safe() -> None:
    for world in (2, 3, 4):
        results = run_ranks(_halving_doubling_cases, world_size=world, timeout=100)
        for rank, res in enumerate(results):
            assert res["bad"] == [], f"p={world} rank {rank}: {res['bad']}"
        logs = [res["log"] for res in results]
        assert all(len(log) > 0 for log in logs)  # type: ignore[arg-type]
        assert nccl_problems(logs) == []  # type: ignore[arg-type]
        if world in (2, 4):
            assert not any(res["halved_only_equal"] for res in results)


def test_bench_cells_print_ratio_and_spread_and_refuse_a_noisy_ratio() -> None:
    from labkit.measure.bench_cells import cell, ratio_and_spread

    # steady rounds: torch 1.2x slower in every round -> ratio 1.20, no spread
    ratio, spread = ratio_and_spread([1.0] * 5, [1.2] * 5)
    assert ratio == pytest.approx(1.2) and spread == pytest.approx(0.0)
    assert cell(ratio, spread).strip() == "1.20x (0%)"
    # load common to both contenders in a round cancels: every round's ratio is still 2
    ratio, spread = ratio_and_spread([1.0, 3.0, 1.0, 5.0, 1.0], [2.0, 6.0, 2.0, 10.0, 2.0])
    assert ratio == pytest.approx(2.0) and spread == pytest.approx(0.0)
    # ratios 1.0 .. 1.4 over 5 rounds: p10 = 1.04, p90 = 1.36, median 1.2 -> spread 26.7%
    ratio, spread = ratio_and_spread([1.0] * 5, [1.0, 1.1, 1.2, 1.3, 1.4])
    assert ratio == pytest.approx(1.2) and spread == pytest.approx(0.32 / 1.2)
    assert cell(ratio, spread).strip() == "1.20x (27%)"
    # negative control: rounds that disagree (0.5x .. 2x) print no ratio at all
    ratio, spread = ratio_and_spread([1.0] * 5, [0.5, 0.8, 1.0, 1.5, 2.0])
    assert spread > 0.30
    assert cell(ratio, spread).strip() == f"noisy (spread {spread:.0%})"
    assert "x" not in cell(ratio, spread)
    with pytest.raises(ValueError, match="same non-zero number of rounds, got 2 ours, 3"):
        ratio_and_spread([1.0, 1.0], [1.0, 1.0, 1.0])


def test_floor_takes_the_slowest_rank_per_round_then_medians() -> None:
    from labkit.measure.floor import floor_from_times

    # rank 1 is slower at the swap, rank 0 at gloo's call: a round is its slowest rank's
    got = floor_from_times([([1e-4, 1e-4, 1e-4], [2e-4] * 3), ([1.5e-4] * 3, [1e-4] * 3)])
    assert got.post_s == pytest.approx(1.5e-4) and got.native_s == pytest.approx(2e-4)
    assert got.ratio == pytest.approx(2 / 1.5) and got.spread == 0.0 and got.rounds == 3
    assert "native/post 1.33x" in str(got)


def test_median_interval_covers_the_median_as_stated_and_verdict_reads_it() -> None:
    import random

    from labkit.measure.bench_cells import median_interval, verdict

    # 9 values at 95%: x[1] .. x[7] (1 - 2 P(B <= 1) = 1 - 20/512 = 96.1%); at 99%: x[0] .. x[8]
    assert median_interval(list(range(9))) == (1, 7)
    assert median_interval(list(range(9)), level=0.99) == (0, 8)
    with pytest.raises(ValueError, match="5 values cannot bound the median at 95%"):
        median_interval([1.0] * 5)
    # coverage by simulation: ratios spread like a busy machine's (lognormal, 40% wide)
    rng = random.Random(0)
    trials, n = 400, 41
    covered = 0
    for _ in range(trials):
        lo, hi = median_interval([rng.lognormvariate(0.0, 0.15) for _ in range(n)])
        covered += lo <= 1.0 <= hi  # the lognormal's median is exp(0) = 1
    assert 0.92 <= covered / trials <= 0.995, covered / trials
    # verdicts: a clear 5% win, a clear 5% loss, and a tie that no run of this size decides
    base = [rng.lognormvariate(0.0, 0.15) for _ in range(301)]
    noise = [rng.lognormvariate(0.0, 0.02) for _ in range(301)]
    assert verdict([b * 0.95 * e for b, e in zip(base, noise)], base).startswith("meets")
    assert verdict([b * 1.05 * e for b, e in zip(base, noise)], base).startswith("MISSES")
    assert verdict([b * e for b, e in zip(base, noise)], base).startswith("undecided")
