"""Pictures of scenario S4 on the emulated cluster (numbers from :mod:`labkit.measure.cluster`).

* :func:`plot_busbw_vs_size`: measured busbw per all-reduce implementation, the alpha-beta
  prediction drawn over it (dashed);
* :func:`plot_strong_scaling`: speed-up and efficiency against nodes, measured and predicted;
* :func:`plot_step_breakdown`: step time split into compute and exposed communication.
"""

from __future__ import annotations

from collections.abc import Mapping

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

__all__ = ["plot_busbw_vs_size", "plot_step_breakdown", "plot_strong_scaling"]


def plot_busbw_vs_size(
    busbw: Mapping[str, Mapping[int, float]],
    predicted: Mapping[str, Mapping[int, float]] | None = None,
    title: str = "all-reduce busbw on the emulated cluster",
) -> Figure:
    """``busbw[impl][bytes]`` in B/s (solid, markers); ``predicted[impl][bytes]`` dashed."""
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    colors = {}
    for impl, row in busbw.items():
        sizes = sorted(row)
        (line,) = ax.plot(sizes, [row[s] / 1e6 for s in sizes], "o-", label=f"{impl} (measured)")
        colors[impl] = line.get_color()
    for impl, row in (predicted or {}).items():
        sizes = sorted(row)
        ax.plot(
            sizes,
            [row[s] / 1e6 for s in sizes],
            "--",
            color=colors.get(impl),
            label=f"{impl} (alpha-beta)",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("busbw (MB/s)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_strong_scaling(
    measured: Mapping[int, Mapping[str, float]],
    predicted: Mapping[int, Mapping[str, float]] | None = None,
    title: str = "strong scaling, fixed global batch",
) -> Figure:
    """Speed-up and efficiency % against nodes; rows carry ``speedup`` and ``efficiency``."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.3))
    nodes = sorted(measured)
    for key, ax, scale in (("speedup", axes[0], 1.0), ("efficiency", axes[1], 100.0)):
        ax.plot(nodes, [measured[n][key] * scale for n in nodes], "o-", label="measured")
        if predicted:
            pn = sorted(predicted)
            ax.plot(pn, [predicted[n][key] * scale for n in pn], "s--", label="alpha-beta")
        ideal = [float(n) for n in nodes] if key == "speedup" else [100.0] * len(nodes)
        ax.plot(nodes, ideal, ":", color="gray", label="ideal")
        ax.set_xlabel("nodes")
        ax.set_xticks(nodes)
        ax.set_title("speed-up" if key == "speedup" else "efficiency %")
    axes[1].set_ylim(0, 110)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_step_breakdown(
    steps: Mapping[str, Mapping[str, float]], title: str = "DDP step time"
) -> Figure:
    """Horizontal bars per variant: compute (step less exposed comm) and exposed comm, in ms."""
    names = list(steps)
    comm = [steps[n]["exposed_comm"] * 1e3 for n in names]
    compute = [steps[n]["step"] * 1e3 - c for n, c in zip(names, comm)]
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(names) + 1.2))
    ax.barh(names, compute, label="compute and overlapped comm")
    ax.barh(names, comm, left=compute, label="exposed comm")
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (median)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
