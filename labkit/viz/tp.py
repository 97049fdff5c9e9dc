"""Pictures for tensor parallelism: measured activation bytes against Korthikanti's formula,
and a layer's communication against its compute on fast and slow links."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

__all__ = ["activation_bars", "comm_vs_compute"]


def activation_bars(
    measured: Mapping[str, float], formula: Mapping[str, float], unit: float = 1e3
) -> Figure:
    """Grouped bars per configuration ("none", "TP t=2", "TP+SP t=2", ...): measured vs formula."""
    names = list(measured)
    xs = range(len(names))
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.bar(
        [x - 0.2 for x in xs],
        [measured[n] / unit for n in names],
        width=0.4,
        label="measured (tracker)",
    )
    ax.bar(
        [x + 0.2 for x in xs],
        [formula[n] / unit for n in names],
        width=0.4,
        label="Korthikanti Table 2 (fp32)",
    )
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("KB per layer per rank" if unit == 1e3 else f"bytes / {unit:g}")
    ax.set_title("Activations one layer keeps for backward")
    ax.legend()
    fig.tight_layout()
    return fig


def comm_vs_compute(
    tps: Sequence[int], rows: Mapping[str, Sequence[tuple[float, float]]]
) -> Figure:
    """``rows[link] = [(compute_s, comm_s) for t in tps]``: communication as a share of the step."""
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for link, pairs in rows.items():
        share = [comm / (comm + compute) for compute, comm in pairs]
        ax.plot(list(tps), [100 * s for s in share], marker="o", label=link)
    ax.set_xlabel("tensor-parallel size t")
    ax.set_ylabel("% of layer time communicating")
    ax.set_xticks(list(tps))
    ax.set_ylim(0, 100)
    ax.set_title("TP communication (no overlap) per layer")
    ax.legend()
    fig.tight_layout()
    return fig
