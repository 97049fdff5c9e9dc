"""The convergence check on screen: validation loss against samples seen, one line per run."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

from labkit.labs.convergence import Curve

__all__ = ["plot_curves"]


def plot_curves(curves: Sequence[Curve], title: str = "short convergence check") -> None:
    """Each run's validation loss at equal samples seen (a diverged run ends where it broke)."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for c in curves:
        ax.plot(c.samples, c.val_loss, marker="o", label=c.label)
    ax.set_xlabel("samples seen")
    ax.set_ylabel("validation loss")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()
