"""Measure collectives the way nccl-tests does (algbw, busbw), ours against torch.distributed.

Definitions (nccl-tests, ``doc/PERFORMANCE.md``), with ``S`` the full tensor size in bytes
(the all-reduce tensor, the reduce-scatter *input*, the all-gather *output*) and ``t`` the time:

    algbw = S / t
    busbw = algbw * factor     factor = 2(p-1)/p (all-reduce), (p-1)/p (reduce-scatter, all-gather)

busbw is the bandwidth each rank's link sustained on a bandwidth-optimal algorithm, so it can
be compared with the link's peak (or, here, with a memcpy) whatever ``p`` is.

Method: tensors are allocated once per size. Each round runs every contender once, ours and
torch's alternating which goes first (so neither always runs on a warmer cache or a quieter
moment), each after a ``barrier`` so all ranks start together. The first ``warmup`` rounds are
dropped. A round's time is the *slowest* rank's (a collective is done when its last rank is);
a record holds the median over rounds and the min and max (``labkit.measure.timing.spread``).

The one-message ping-pong (the alpha-beta fit) is in ``ping_pong.py``, the ring step by step
(the lesson's picture) in ``ring_trace.py``; both are re-exported here.

"ours" is what labkit uses where speed matters: for all-reduce, ``collectives.auto.all_reduce``
(recursive doubling below a measured size, the tuned ring above); for reduce-scatter and
all-gather, the tuned ring.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from labkit.collectives import auto
from labkit.collectives.common import chunk_sizes
from labkit.collectives.cost_model import busbw_factor
from labkit.collectives.naive import naive_all_reduce
from labkit.collectives.ring import ring_all_reduce
from labkit.collectives.ring_tuned import tuned_all_gather, tuned_all_reduce, tuned_reduce_scatter
from labkit.collectives.tree import halving_doubling_all_reduce, recursive_doubling_all_reduce
from labkit.measure.bench_cells import cell, ratio_and_spread
from labkit.measure.ping_pong import pair_one_way, ping_pong
from labkit.measure.ring_trace import ring_snapshots, traced_ring
from labkit.measure.timing import spread

__all__ = [
    "BenchRecord",
    "DEFAULT_SIZES",
    "OPS",
    "run_bench",
    "ratios",
    "format_table",
    "human_bytes",
    "memcpy_bandwidth",
    "pair_one_way",
    "ping_pong",
    "ring_snapshots",
    "traced_ring",
]

OPS = ("all_reduce", "reduce_scatter", "all_gather")
DEFAULT_SIZES = tuple(4096 * 4**k for k in range(9))  # 4 KB, 16 KB, ..., 256 MB


@dataclass(frozen=True)
class BenchRecord:
    """One (collective, implementation, size) measurement; seconds and bytes per second."""

    op: str
    impl: str  # "ours", "torch", or an algorithm's name
    world_size: int
    nbytes: int
    time_s: float  # median over rounds
    algbw: float
    busbw: float
    time_min: float = 0.0
    time_max: float = 0.0
    rounds: tuple[float, ...] = ()  # every round's time (slowest rank), in round order


def _native(name: str, old: str) -> Callable[..., object]:
    """torch 2.13's name of a collective, or its older name on older torch."""
    return getattr(dist, name, None) or getattr(dist, old)


def _runs(
    full: torch.Tensor, shard: torch.Tensor, algorithms: bool | Sequence[str]
) -> dict[str, dict[str, Callable[[], object]]]:
    """op -> {"ours": call, "torch": call, ...} on preallocated tensors. Ours run as ``Comm``
    runs them, ``check=False``: no cross-rank check and no settle (``collectives/guard.py``),
    since torch's collectives check nothing either (a check=True call adds one settle)."""
    all_reduce: dict[str, Callable[[], object]] = {
        "ours": lambda: auto.all_reduce(full, check=False),
        "torch": lambda: dist.all_reduce(full),
    }
    if algorithms:  # every algorithm on its own, for the small-message comparison
        all_reduce["tuned ring"] = lambda: tuned_all_reduce(full, check=False)
        all_reduce["readable ring"] = lambda: ring_all_reduce(full, check=False)
        all_reduce["recursive doubling"] = lambda: recursive_doubling_all_reduce(full, check=False)
        all_reduce["halving-doubling"] = lambda: halving_doubling_all_reduce(full, check=False)
        all_reduce["naive"] = lambda: naive_all_reduce(full, check=False)
        if not isinstance(algorithms, bool):  # only the named ones (fewer: shorter rounds)
            all_reduce = {
                k: f for k, f in all_reduce.items() if k in ("ours", "torch", *algorithms)
            }
    return {
        "all_reduce": all_reduce,
        "reduce_scatter": {
            "ours": lambda: tuned_reduce_scatter(shard, full, check=False),
            "torch": lambda: _native("reduce_scatter_single", "reduce_scatter_tensor")(shard, full),
        },
        "all_gather": {
            "ours": lambda: tuned_all_gather(full, shard, check=False),
            "torch": lambda: _native("all_gather_single", "all_gather_into_tensor")(full, shard),
        },
    }


def _rank_bench(
    ops: Sequence[str],
    sizes: Sequence[int],
    repeats: int,
    warmup: int,
    dtype: torch.dtype,
    algorithms: bool | Sequence[str],
) -> dict[str, list[float]]:
    """Runs on every rank: this rank's time of every round, keyed ``op|impl|nbytes``."""
    from labkit.launch import local_device

    rank, p = dist.get_rank(), dist.get_world_size()
    device = local_device()
    itemsize = torch.tensor([], dtype=dtype).element_size()
    times: dict[str, list[float]] = {}
    for nbytes in sizes:
        n = max(p, nbytes // itemsize // p * p)  # divisible by p, so native RS/AG accept it
        full = torch.randn(n, device=device).to(dtype)
        shard = torch.empty(chunk_sizes(n, p)[rank], dtype=dtype, device=device)
        runs = _runs(full, shard, algorithms)
        for op in ops:
            names = list(runs[op])
            for i in range(warmup + repeats):
                for impl in names[::-1] if i % 2 else names:  # alternate who goes first
                    dist.barrier()
                    t0 = time.perf_counter()
                    runs[op][impl]()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    if i >= warmup:
                        key = f"{op}|{impl}|{n * itemsize}"
                        times.setdefault(key, []).append(time.perf_counter() - t0)
                if op == "all_reduce":
                    full.normal_()  # repeated sums grow; keep the data ordinary
        del full, shard, runs  # free before the next size
    return times


def run_bench(
    world_size: int = 2,
    sizes: Sequence[int] = DEFAULT_SIZES,
    ops: Sequence[str] = OPS,
    *,
    repeats: int = 5,
    warmup: int = 1,
    dtype: torch.dtype = torch.float32,
    algorithms: bool | Sequence[str] = False,
    timeout: float = 600.0,
) -> list[BenchRecord]:
    """Benchmark ``ops`` at each size (bytes) on ``world_size`` gloo ranks, contenders interleaved.

    ``impl`` of a record is "ours" or "torch"; with ``algorithms=True`` the all-reduce also
    times each algorithm alone ("tuned ring", "readable ring", "recursive doubling",
    "halving-doubling", "naive"); a sequence of those names times only them.
    """
    check_bench(ops, sizes, repeats, warmup)
    from labkit.launch import launch

    per_rank = launch(
        _rank_bench,
        list(ops),
        list(sizes),
        repeats,
        warmup,
        dtype,
        algorithms,
        world_size=world_size,
        timeout=timeout,
        quiet=True,
        backend="gloo",
    )
    return bench_records(per_rank, repeats, world_size)


def check_bench(ops: Sequence[str], sizes: Sequence[int], repeats: int, warmup: int) -> None:
    """ValueError for what :func:`run_bench` cannot run, before any process starts."""
    bad = [op for op in ops if op not in OPS]
    if bad or not sizes or repeats < 1 or warmup < 0:
        raise ValueError(
            f"ops must be among {OPS} (got {list(ops)}), sizes non-empty, "
            f"repeats >= 1 (got {repeats}), warmup >= 0 (got {warmup})"
        )


def bench_records(per_rank: list[Any], repeats: int, world_size: int) -> list[BenchRecord]:
    """The records of :func:`run_bench` from every rank's ``_rank_bench`` times: per round
    the slowest rank, then the spread over rounds."""
    records = []
    for key in per_rank[0]:
        op, impl, nbytes = key.split("|")
        rounds = [max(rank_times[key][i] for rank_times in per_rank) for i in range(repeats)]
        s = spread(rounds)
        algbw = int(nbytes) / s.median
        busbw = algbw * busbw_factor(op, world_size)
        records.append(
            BenchRecord(
                op,
                impl,
                world_size,
                int(nbytes),
                s.median,
                algbw,
                busbw,
                s.min,
                s.max,
                tuple(rounds),
            )
        )
    return records


def ratios(records: Sequence[BenchRecord], impl: str = "ours") -> dict[tuple[str, int], float]:
    """``(op, nbytes) -> busbw(impl) / busbw(torch)``, i.e. torch's time over ours."""
    by = {(r.op, r.impl, r.nbytes): r for r in records}
    return {
        (op, n): by[(op, impl, n)].busbw / by[(op, "torch", n)].busbw
        for (op, i, n) in by
        if i == impl and (op, "torch", n) in by
    }


def human_bytes(nbytes: float) -> str:
    """``4096 -> '4 KB'``, ``268435456 -> '256 MB'`` (powers of 1024)."""
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if nbytes == int(nbytes) else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.0f} GB"


def _rate(bytes_per_s: float) -> str:
    """A bandwidth with a unit that keeps three significant digits (never ``0.00 GB/s``)."""
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.3g} {unit}"
    return f"{bytes_per_s / 1e3:.3g} KB/s"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def format_table(
    records: Sequence[BenchRecord], ops: Sequence[str] = OPS, memcpy: float | None = None
) -> str:
    """One line per (op, size): median times, ours's busbw, and the cell of ``bench_cells``:
    the median per-round ratio torch time / ours with its spread, or "noisy (spread N%)"."""
    by = {(r.op, r.impl, r.nbytes): r for r in records}
    cols = f"{'op':<15}{'size':>8}{'ours':>11}{'torch':>11}{'ours busbw':>13}"
    lines = [cols + f"{'ours/torch (spread)':>21}" + ("  ours/memcpy" if memcpy else "")]
    for (op, n), ratio in ratios(records).items():
        if op not in ops:
            continue
        ours, native = by[(op, "ours", n)], by[(op, "torch", n)]
        spread_ = 0.0
        if ours.rounds and native.rounds:
            ratio, spread_ = ratio_and_spread(ours.rounds, native.rounds)
        line = (
            f"{op:<15}{human_bytes(n):>8}{_ms(ours.time_s):>11}{_ms(native.time_s):>11}"
            f"{_rate(ours.busbw):>13}{cell(ratio, spread_, 21)}"
        )
        lines.append(line + (f"{ours.busbw / memcpy:>13.0%}" if memcpy else ""))
    return "\n".join(lines)


def memcpy_bandwidth(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Single-thread copy bandwidth in bytes copied per second (a CPU reference for busbw)."""
    src, dst = torch.ones(nbytes // 4), torch.zeros(nbytes // 4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return nbytes / best
