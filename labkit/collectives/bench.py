"""Measure collectives the way nccl-tests does: algbw and busbw, ours against torch.distributed.

Definitions (nccl-tests, ``doc/PERFORMANCE.md``), with ``S`` the full tensor size in bytes
(the all-reduce tensor, the reduce-scatter *input*, the all-gather *output*) and ``t`` the time:

    algbw = S / t
    busbw = algbw * factor     factor = 2(p-1)/p (all-reduce), (p-1)/p (reduce-scatter, all-gather)

busbw is the bandwidth each rank's link actually sustained on a bandwidth-optimal algorithm,
so it can be compared with the link's peak (or, here, with a memcpy) whatever ``p`` is.

Method: every rank allocates its tensors once per size; for each repeat, ours and the native
collective run back to back (interleaved, so machine noise hits both alike), each after a
``barrier`` so all ranks start together. A repeat's time is the *slowest* rank's (a collective
is done when its last rank is done); the record holds the median over repeats.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from labkit.collectives.common import chunk_sizes
from labkit.collectives.cost_model import busbw_factor
from labkit.collectives.naive import naive_all_reduce
from labkit.collectives.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from labkit.collectives.tree import recursive_doubling_all_reduce

__all__ = [
    "BenchRecord",
    "DEFAULT_SIZES",
    "run_bench",
    "ratios",
    "format_table",
    "plot_busbw",
    "memcpy_bandwidth",
    "ring_snapshots",
    "plot_ring_snapshots",
]

OPS = ("all_reduce", "reduce_scatter", "all_gather")
DEFAULT_SIZES = tuple(4096 * 4**k for k in range(9))  # 4 KB, 16 KB, ..., 256 MB


@dataclass(frozen=True)
class BenchRecord:
    """One (collective, implementation, size) measurement; times in seconds, bandwidths in B/s."""

    op: str
    impl: str  # "ours" or "torch"
    world_size: int
    nbytes: int
    time_s: float
    algbw: float
    busbw: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _native_rs(out: torch.Tensor, inp: torch.Tensor) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp)


def _native_ag(out: torch.Tensor, inp: torch.Tensor) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp)


def _runs(full: torch.Tensor, shard: torch.Tensor, algorithms: bool) -> dict[str, dict[str, Callable[[], object]]]:
    """op -> {"ours": call, "torch": call, ...} on preallocated tensors."""
    all_reduce: dict[str, Callable[[], object]] = {"ours": lambda: ring_all_reduce(full), "torch": lambda: dist.all_reduce(full)}
    if algorithms:  # the other all-reduce algorithms, for the small-message comparison
        all_reduce["naive"] = lambda: naive_all_reduce(full)
        all_reduce["recursive doubling"] = lambda: recursive_doubling_all_reduce(full)
    return {
        "all_reduce": all_reduce,
        "reduce_scatter": {"ours": lambda: ring_reduce_scatter(shard, full), "torch": lambda: _native_rs(shard, full)},
        "all_gather": {"ours": lambda: ring_all_gather(full, shard), "torch": lambda: _native_ag(full, shard)},
    }


def _rank_bench(
    ops: Sequence[str], sizes: Sequence[int], repeats: int, warmup: int, dtype: torch.dtype, algorithms: bool
) -> dict[str, list[float]]:
    """Runs on every rank: this rank's time of every repeat, keyed ``op|impl|nbytes``."""
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
            for i in range(warmup + repeats):
                for impl, fn in runs[op].items():
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    if i >= warmup:
                        times.setdefault(f"{op}|{impl}|{n * itemsize}", []).append(time.perf_counter() - t0)
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
    algorithms: bool = False,
    timeout: float = 600.0,
) -> list[BenchRecord]:
    """Benchmark ``ops`` at each size (bytes) on ``world_size`` ranks; ours vs torch, interleaved.

    ``impl`` of a record is "ours" (the ring) or "torch"; with ``algorithms=True`` the
    all-reduce also times "naive" and "recursive doubling".
    """
    bad = [op for op in ops if op not in OPS]
    if bad or not sizes or repeats < 1 or warmup < 0:
        raise ValueError(f"ops must be among {OPS} (got {list(ops)}), sizes non-empty, repeats >= 1, warmup >= 0")
    from labkit.launch import launch

    per_rank = launch(_rank_bench, list(ops), list(sizes), repeats, warmup, dtype, algorithms, world_size=world_size, timeout=timeout, quiet=True)
    records = []
    for key in per_rank[0]:
        op, impl, nbytes = key.split("|")
        slowest = [max(rank_times[key][i] for rank_times in per_rank) for i in range(repeats)]
        t = statistics.median(slowest)
        algbw = int(nbytes) / t
        records.append(BenchRecord(op, impl, world_size, int(nbytes), t, algbw, algbw * busbw_factor(op, world_size)))
    return records


def ratios(records: Sequence[BenchRecord]) -> dict[tuple[str, int], float]:
    """``(op, nbytes) -> busbw(ours) / busbw(torch)``."""
    by = {(r.op, r.impl, r.nbytes): r for r in records}
    return {(op, n): by[(op, "ours", n)].busbw / by[(op, "torch", n)].busbw for (op, impl, n) in by if impl == "ours" and (op, "torch", n) in by}


def _human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:.0f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.0f} GB"


def format_table(records: Sequence[BenchRecord], memcpy: float | None = None) -> str:
    """One line per (op, size): time and busbw of ours and torch's, their ratio, % of memcpy."""
    by = {(r.op, r.impl, r.nbytes): r for r in records}
    head = f"{'op':<15}{'size':>9}{'ours ms':>10}{'torch ms':>10}{'ours GB/s':>11}{'torch GB/s':>11}{'ours/torch':>11}"
    lines = [head + ("   ours/memcpy" if memcpy else "")]
    for (op, n), ratio in ratios(records).items():
        ours, native = by[(op, "ours", n)], by[(op, "torch", n)]
        line = f"{op:<15}{_human(n):>9}{ours.time_s * 1e3:>10.2f}{native.time_s * 1e3:>10.2f}{ours.busbw / 1e9:>11.2f}{native.busbw / 1e9:>11.2f}{ratio:>10.2f}x"
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


def plot_busbw(records: Sequence[BenchRecord], ax: Any = None) -> Any:
    """busbw against size, one line per (op, impl); ours solid, torch dashed. Returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    for op in dict.fromkeys(r.op for r in records):
        for impl in dict.fromkeys(r.impl for r in records):
            pts = sorted((r.nbytes, r.busbw / 1e9) for r in records if r.op == op and r.impl == impl)
            if pts:
                ax.plot(*zip(*pts), "-o" if impl == "ours" else "--x", label=f"{op} ({impl})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size S (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    p = records[0].world_size if records else "?"
    ax.set_title(f"bus bandwidth, {p} ranks")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return ax


# ---- the ring, step by step, from a real run ------------------------------------------------


def _traced_ring() -> list[tuple[str, int, int, int]]:
    rank, p = dist.get_rank(), dist.get_world_size()
    seen: list[tuple[str, int, int, int]] = []
    x = torch.full((p,), float(2**rank))  # rank r adds 2**r: a partial sum spells who is in it
    ring_all_reduce(x, trace=lambda phase, step, c, data: seen.append((phase, step, c, int(data[0].item()))))
    return seen


def ring_snapshots(world_size: int = 4) -> list[tuple[str, list[list[int]]]]:
    """Run a ring all-reduce on ``world_size`` ranks and return who-holds-what after each step.

    Returns ``[(title, masks), ...]``: the initial state, then one entry per step of the
    reduce-scatter and of the all-gather. ``masks[rank][chunk]`` is a bitmask of the ranks whose
    data that rank's copy of that chunk contains, read from the values that actually arrived.
    """
    from labkit.launch import launch

    traces = launch(_traced_ring, world_size=world_size, quiet=True, timeout=120)
    p = world_size
    masks = [[1 << r for _ in range(p)] for r in range(p)]
    states = [("start", [row[:] for row in masks])]
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(p - 1):
            for rank, trace in enumerate(traces):
                for ph, s, chunk, mask in trace:
                    if ph == phase and s == step:
                        masks[rank][chunk] = mask
            states.append((f"{phase} step {step}", [row[:] for row in masks]))
    return states


def plot_ring_snapshots(states: Sequence[tuple[str, list[list[int]]]]) -> Any:
    """One panel per step: rows are ranks, columns chunks, text = contributing ranks."""
    import matplotlib.pyplot as plt

    p = len(states[0][1])
    fig, axes = plt.subplots(1, len(states), figsize=(2.1 * len(states), 2.6), squeeze=False)
    for ax, (title, masks) in zip(axes[0], states):
        counts = [[bin(m).count("1") for m in row] for row in masks]
        ax.imshow(counts, cmap="Blues", vmin=0, vmax=p + 1)
        for r in range(p):
            for c in range(p):
                who = "".join(str(k) for k in range(p) if masks[r][c] >> k & 1)
                ax.text(c, r, who, ha="center", va="center", fontsize=7)
        ax.set_title(title, fontsize=8)
        ax.set_xticks(range(p), [f"c{c}" for c in range(p)], fontsize=7)
        ax.set_yticks(range(p), [f"r{r}" for r in range(p)], fontsize=7)
    fig.tight_layout()
    return fig
