"""Step breakdowns as pictures: one stacked bar per rank, runs side by side."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from labkit.profiling.breakdown import CATEGORIES, Breakdown

COLOURS = {
    "data": "#d62728",
    "h2d": "#ff7f0e",
    "forward": "#1f77b4",
    "backward": "#17becf",
    "comm": "#9467bd",
    "optimizer": "#2ca02c",
    "other": "#7f7f7f",
}


def plot_breakdown(runs: Mapping[str, Sequence[Breakdown]], title: str = "step breakdown per rank"):
    """Stacked bars (ms per step), every rank of every run: ``{"clean": [...], "x": [...]}``."""
    import matplotlib.pyplot as plt

    labels, bars = [], []
    for name, breakdowns in runs.items():
        for b in breakdowns:
            labels.append(f"{name}\nrank {b.rank}")
            bars.append(b)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(bars) + 2), 3.6))
    bottom = [0.0] * len(bars)
    for c in CATEGORIES:
        ms = [b.seconds[c] * 1e3 for b in bars]
        ax.bar(range(len(bars)), ms, bottom=bottom, color=COLOURS[c], label=c)
        bottom = [x + y for x, y in zip(bottom, ms)]
    ax.set_xticks(range(len(bars)), labels, fontsize=8)
    ax.set_ylabel("ms per step (median)")
    ax.set_title(title)
    ax.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
    fig.tight_layout()
    return fig


def plot_scaling(
    ranks: Sequence[int],
    efficiency: Mapping[str, Sequence[float]],
    title: str = "scaling efficiency",
):
    """Efficiency against the number of ranks, one line per kind (strong, weak)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    for name, eff in efficiency.items():
        ax.plot(list(ranks), list(eff), marker="o", label=name)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("ranks")
    ax.set_ylabel("efficiency")
    ax.set_xticks(list(ranks))
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig
