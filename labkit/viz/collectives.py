"""Pictures of lesson 02 (collectives): the ring step by step, busbw, the alpha-beta model.

Every function takes measured records or model numbers and returns a matplotlib ``Figure``.
Sizes are labelled in KB/MB (powers of 1024), times in ms or us, so that no axis shows raw
powers of two; texts are at least 10 pt so they read at 100% zoom.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from labkit.measure.collectives import BenchRecord, human_bytes
from labkit.measure.timing import Spread, spread

__all__ = ["plot_ring_snapshots", "plot_busbw", "plot_algorithms", "plot_ping_pong"]

TEXT = 10  # points: the smallest text on any figure here


def _size_axis(ax: Any, sizes: Sequence[float]) -> None:
    """Log-2 x axis with one tick per measured size, labelled 4 KB ... 256 MB."""
    ax.set_xscale("log", base=2)
    ticks = sorted(set(sizes))
    ax.set_xticks(
        ticks, [human_bytes(s) for s in ticks], fontsize=TEXT, rotation=45 if len(ticks) > 6 else 0
    )
    ax.minorticks_off()
    ax.set_xlabel("message size", fontsize=TEXT)


def _log_y(ax: Any, label: str) -> None:
    """Log y axis with plain-number tick labels (0.1, 1, 10), not 10^0 or 3x10^0."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.set_ylabel(label, fontsize=TEXT)
    ax.tick_params(labelsize=TEXT)
    ax.grid(True, which="major", alpha=0.3)


def _finish(fig: Any, ax: Any, sizes: Sequence[float], ylabel: str, title: str) -> Any:
    """Size axis in KB/MB, log y with plain ticks, a title and a legend; returns ``fig``."""
    _size_axis(ax, sizes)
    _log_y(ax, ylabel)
    ax.set_title(title, fontsize=TEXT + 1)
    ax.legend(fontsize=TEXT - 1)
    fig.tight_layout()
    return fig


def _spread_bars(
    ax: Any, x: Sequence[float], spreads: Sequence[Spread], unit: float, fmt: str, label: str
) -> None:
    """Median markers with min..max error bars, times scaled by ``unit`` (1e3: ms, 1e6: us)."""
    mid = [s.median * unit for s in spreads]
    low = [m - s.min * unit for m, s in zip(mid, spreads)]
    high = [s.max * unit - m for m, s in zip(mid, spreads)]
    ax.errorbar(x, mid, yerr=[low, high], fmt=fmt, capsize=3, label=label)


def plot_ring_snapshots(states: Sequence[tuple[str, list[list[int]]]]) -> Any:
    """One panel per step: rows are ranks, columns chunks, text = the ranks whose data it holds.

    Colour = how many ranks are in it, on a light-to-dark scale whose text switches from black
    to white where the cell gets dark, so every label keeps its contrast.
    """
    import matplotlib.pyplot as plt

    p = len(states[0][1])
    cols = min(len(states), 4)
    rows = -(-len(states) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False)
    cmap = plt.get_cmap("YlGnBu")
    for ax in axes.flat[len(states) :]:
        ax.axis("off")
    for ax, (title, masks) in zip(axes.flat, states):
        counts = [[bin(m).count("1") for m in row] for row in masks]
        ax.imshow(counts, cmap=cmap, vmin=0.5, vmax=p + 0.5)
        for r in range(p):
            for c in range(p):
                who = "".join(str(k) for k in range(p) if masks[r][c] >> k & 1)
                dark = counts[r][c] / p > 0.6
                ax.text(
                    c,
                    r,
                    who,
                    ha="center",
                    va="center",
                    fontsize=TEXT + 2,
                    fontweight="bold",
                    color="white" if dark else "black",
                )
        ax.set_title(title, fontsize=TEXT + 1)
        ax.set_xticks(range(p), [f"chunk {c}" for c in range(p)], fontsize=TEXT - 1)
        ax.set_yticks(range(p), [f"rank {r}" for r in range(p)], fontsize=TEXT)
    fig.suptitle(
        "which ranks' data each rank holds, chunk by chunk (darker = more ranks)", fontsize=TEXT + 2
    )
    fig.tight_layout()
    return fig


def plot_busbw(records: Sequence[BenchRecord], ops: Sequence[str] | None = None) -> Any:
    """busbw against size, one line per (op, impl): ours solid, torch dashed; log-log."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for colour, op in enumerate(ops or dict.fromkeys(r.op for r in records)):
        for impl in dict.fromkeys(r.impl for r in records):  # one colour per op: ours vs torch
            pts = sorted(
                (r.nbytes, r.busbw / 1e9) for r in records if r.op == op and r.impl == impl
            )
            if pts:
                style = "-o" if impl == "ours" else "--x"
                ax.plot(*zip(*pts), style, color=f"C{colour}", label=f"{op} ({impl})")
    p = records[0].world_size if records else "?"
    title = f"bus bandwidth, {p} ranks (higher is better)"
    return _finish(fig, ax, [r.nbytes for r in records], "busbw (GB/s)", title)


def plot_algorithms(
    model: dict[str, Callable[[float], float]],
    model_title: str,
    records: Sequence[BenchRecord],
    crossover: float | None = None,
) -> Any:
    """Two panels: the alpha-beta model's time per algorithm, and measured times (min..max bars)."""
    import matplotlib.pyplot as plt

    fig, (model_ax, measured_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    grid = [2.0**k for k in range(12, 29, 2)]  # 4 KB .. 256 MB
    for name, seconds in model.items():
        model_ax.plot(grid, [seconds(d) * 1e3 for d in grid], label=name)
    if crossover is not None and grid[0] <= crossover <= grid[-1]:
        model_ax.axvline(
            crossover, color="gray", ls=":", label=f"crossover {human_bytes(crossover)}"
        )
    _finish(fig, model_ax, grid, "time (ms)", model_title)
    for impl in dict.fromkeys(r.impl for r in records):
        rs = sorted((r for r in records if r.impl == impl), key=lambda r: r.nbytes)
        spreads = [Spread(r.time_min, r.time_s, r.time_max, 0) for r in rs]
        _spread_bars(measured_ax, [r.nbytes for r in rs], spreads, 1e3, "-o", impl)
    p = records[0].world_size if records else "?"
    sizes = [r.nbytes for r in records]
    ylabel = "time (ms), median with min..max"
    return _finish(fig, measured_ax, sizes, ylabel, f"measured all-reduce, {p} ranks")


def plot_ping_pong(
    one_way: dict[int, list[float]], fit: Callable[[float], float] | None = None
) -> Any:
    """One-way message time against size: median with min..max bars, and the fitted line."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    sizes = sorted(one_way)
    spreads = [spread(one_way[n]) for n in sizes]
    _spread_bars(ax, sizes, spreads, 1e6, "o", "measured: median, min..max")
    if fit is not None:
        ax.plot(sizes, [fit(s) * 1e6 for s in sizes], "--", label="fit: alpha + n * beta")
    return _finish(fig, ax, sizes, "one-way time (us)", "one message between two ranks")
