"""Pictures of notebook 10 (10B on mixed interconnects): the planner's communication terms
against the inter-node bandwidth, and the miniature's measured step next to its prediction."""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt

__all__ = ["plot_miniature", "plot_slow_link_scan"]

TERMS = ("tp_comm", "pp_comm", "dp_comm")


def plot_slow_link_scan(rows: list[dict[str, float]], title: str = "") -> Any:
    """Each communication term and the step (seconds) over the inter-node bandwidth per GPU
    (rows of :func:`labkit.labs.mixed_links.slow_link_scan`), log-log."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    gbps = [r["inter_bandwidth"] * 8 / 1e9 for r in rows]  # bytes/s -> Gb/s
    for key in (*TERMS, "step"):
        ax.plot(gbps, [max(r[key], 1e-4) for r in rows], marker="o", label=key)
    ax.set(xscale="log", yscale="log", xlabel="inter-node Gb/s per GPU",
           ylabel="seconds per step", title=title)  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_miniature(rows: list[dict[str, Any]]) -> Any:
    """Bars: measured and predicted step seconds per miniature layout (rows with keys
    ``layout``, ``measured``, ``predicted``)."""
    fig, ax = plt.subplots(figsize=(6, 3))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["measured"] for r in rows], 0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], [r["predicted"] for r in rows], 0.4, label="planner")
    ax.set_xticks(list(xs), [r["layout"] for r in rows], fontsize=8)
    ax.set(ylabel="seconds per step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
