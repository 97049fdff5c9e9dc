"""FP8 on screen: where each format's values lie, and the training curves against bf16."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt

from labkit.precision.fp8.formats import FORMATS, representable

__all__ = ["plot_fp8_curves", "plot_formats"]


def plot_formats() -> None:
    """Every positive e4m3 and e5m2 value on a log axis, subnormals marked: the density of a
    format is its precision, its extent the range."""
    fig, ax = plt.subplots(figsize=(7.0, 2.3))
    for y, name in enumerate(("e4m3", "e5m2")):
        v = representable(name)[1:]  # zero has no place on a log axis
        sub = v < FORMATS[name].min_normal
        ax.scatter(v[~sub], [y] * int((~sub).sum()), marker="|", s=120, label=f"{name} normal")
        ax.scatter(v[sub], [y] * int(sub.sum()), marker="|", s=120, label=f"{name} subnormal")
    ax.set_xscale("log", base=2)
    ax.set_yticks([0, 1], ["e4m3", "e5m2"])
    ax.set_ylim(-0.6, 1.6)
    ax.set_xlabel("value (log2 axis)")
    ax.legend(fontsize=7, ncol=4, loc="upper left", bbox_to_anchor=(0, -0.6))  # below the label
    fig.tight_layout()
    plt.show()


def _smooth(curve: Sequence[float], k: int) -> list[float]:
    return [sum(curve[max(0, i - k + 1) : i + 1]) / len(curve[max(0, i - k + 1) : i + 1])
            for i in range(len(curve))]  # fmt: skip


def plot_fp8_curves(bf16: Mapping[int, Sequence[float]], fp8: Mapping[str, Sequence[float]],
                    smooth: int = 10) -> None:  # fmt: skip
    """bf16 at each seed (grey: the seed-to-seed band) and each FP8 run, moving averages of
    ``smooth`` steps."""
    fig, ax = plt.subplots(figsize=(6.8, 3.8))
    for seed, c in bf16.items():
        ax.plot(_smooth(c, smooth), color="0.6", lw=1, label=f"bf16 seed {seed}")
    for name, c in fp8.items():
        ax.plot(_smooth(c, smooth), lw=1.3, label=f"fp8 {name}")
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss ({smooth}-step mean)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    plt.show()
