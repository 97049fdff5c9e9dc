"""The small-message floor: what one exchange costs from Python, against gloo's own all-reduce.

At 4 KB a collective is all latency, and two latencies set it:

* ``post`` (``labkit.collectives.common.post``): one ``batch_isend_irecv`` swap with the
  partner, waited on. Every step of labkit's hand-written collectives pays this: Python builds
  ``P2POp`` objects, torch dispatches two work items, gloo matches them with the peer, and the
  Python thread wakes on each ``wait``. Recursive doubling on ``p`` ranks pays it ``log2 p`` times.
* ``native``: ``dist.all_reduce`` of one float32 (4 bytes). gloo runs its whole algorithm in
  C++, one call from Python, one wait.

Their ratio ``native / post`` is the best a Python-driven all-reduce can hope for at tiny
sizes on 2 ranks (one swap = the whole recursive doubling). Both are timed interleaved, each
call after a barrier, warm-up dropped, the slowest rank's time per round, then the median.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from labkit.collectives.common import post
from labkit.measure.bench_cells import ratio_and_spread
from labkit.measure.collectives import OPS, BenchRecord, _rank_bench, bench_records, check_bench

__all__ = ["Floor", "bench_and_floor", "floor_from_times", "rank_floor", "small_message_floor"]


@dataclass(frozen=True)
class Floor:
    """Median seconds of one ``post`` swap and of gloo's 4-byte all-reduce, and their spread."""

    post_s: float
    native_s: float
    ratio: float  # median over rounds of native / post (> 1: the Python swap is faster)
    spread: float  # (p90 - p10) / median of that per-round ratio (bench_cells)
    rounds: int

    def __str__(self) -> str:
        return (
            f"small-message floor (2 ranks, 4 bytes, {self.rounds} interleaved rounds): "
            f"one post() swap {self.post_s * 1e6:.0f} us, gloo all_reduce "
            f"{self.native_s * 1e6:.0f} us, native/post {self.ratio:.2f}x "
            f"(spread {self.spread:.0%})"
        )


def rank_floor(repeats: int, warmup: int) -> tuple[list[float], list[float]]:
    """Run on every rank of a 2-rank world: this rank's seconds per round, (post, native)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    if p != 2:
        raise ValueError(f"the floor is a 2-rank measurement, got world size {p}")
    peer = 1 - rank
    send, recv, one = torch.ones(1), torch.empty(1), torch.ones(1)

    def swap() -> None:
        recv_works, send_works = post([(send, peer)], [(recv, peer)], None)
        for work in recv_works + send_works:
            work.wait()

    calls = {"post": swap, "native": lambda: dist.all_reduce(one)}
    times: dict[str, list[float]] = {"post": [], "native": []}
    for i in range(warmup + repeats):
        for name in ("post", "native") if i % 2 == 0 else ("native", "post"):
            dist.barrier()
            t0 = time.perf_counter()
            calls[name]()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times["post"], times["native"]


def small_message_floor(repeats: int = 41, warmup: int = 5, timeout: float = 60) -> Floor:
    """Launch 2 gloo ranks and measure the floor (see the module docstring)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    from labkit.launch import launch

    per_rank = launch(
        rank_floor, repeats, warmup, world_size=2, timeout=timeout, quiet=True, backend="gloo"
    )
    return floor_from_times(per_rank)


def floor_from_times(per_rank: list[tuple[list[float], list[float]]]) -> Floor:
    """Combine ranks' ``(post, native)`` times: the slowest rank per round, then medians."""
    swap = [max(r[0][i] for r in per_rank) for i in range(len(per_rank[0][0]))]
    native = [max(r[1][i] for r in per_rank) for i in range(len(per_rank[0][1]))]
    ratio, spread = ratio_and_spread(swap, native)
    return Floor(statistics.median(swap), statistics.median(native), ratio, spread, len(swap))


def _bench_then_floor(args: tuple[Any, ...], repeats: int, warmup: int) -> tuple[Any, Any]:
    """On each of the 2 ranks: the benchmark's round times, then the floor's."""
    return _rank_bench(*args), rank_floor(repeats, warmup)


def bench_and_floor(
    sizes: Sequence[int],
    *,
    repeats: int = 5,
    warmup: int = 1,
    algorithms: bool | Sequence[str] = False,
    floor_repeats: int = 41,
    floor_warmup: int = 5,
    timeout: float = 600.0,
) -> tuple[list[BenchRecord], Floor]:
    """:func:`labkit.measure.collectives.run_bench` on 2 ranks (all ops, float32), then the
    floor, in ONE launch: a fresh 2-rank launch costs seconds of start-up, more than the floor."""
    check_bench(OPS, sizes, repeats, warmup)
    if floor_repeats < 1 or floor_warmup < 0:
        raise ValueError(f"need floor_repeats >= 1 and floor_warmup >= 0, got {floor_repeats}, "
                         f"{floor_warmup}")  # fmt: skip
    from labkit.launch import launch

    args = (list(OPS), list(sizes), repeats, warmup, torch.float32, algorithms)
    per_rank = launch(
        _bench_then_floor, args, floor_repeats, floor_warmup, world_size=2, timeout=timeout,
        quiet=True, backend="gloo",
    )  # fmt: skip
    return bench_records([r[0] for r in per_rank], repeats, 2), floor_from_times(
        [r[1] for r in per_rank]
    )
