"""The ZeRO memory ledger as stacked bars: measured at the peak next to the model's prediction."""

from __future__ import annotations

from typing import Any

__all__ = ["ledger_bars"]

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3")
MiB = 2**20


def ledger_bars(ledger: list[dict[str, Any]], title: str = "") -> Any:
    """One pair of bars per stage: the breakdown when the measured total peaked (solid) and
    the predicted model states (hatched). ``ledger``: :func:`labkit.zero.measure` records."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for i, r in enumerate(ledger):
        bottom_m = bottom_p = 0.0
        for cat, color in zip(CATEGORIES, COLORS):
            m = r["at_peak"][cat] / MiB
            ax.bar(3 * i, m, bottom=bottom_m, color=color, label=cat if i == 0 else None)
            bottom_m += m
            if cat in r["predicted"]:
                p = r["predicted"][cat] / MiB
                ax.bar(3 * i + 1, p, bottom=bottom_p, color=color, hatch="//", alpha=0.6)
                bottom_p += p
    ax.set_xticks([3 * i + 0.5 for i in range(len(ledger))])
    ax.set_xticklabels([f"{r['stage']}\nmeasured | predicted" for r in ledger])
    ax.set_ylabel("MiB per rank")
    ax.legend(fontsize=8)
    ax.set_title(title or "Per-rank memory at the peak: measured (solid), model states (hatched)")
    fig.tight_layout()
    return fig
