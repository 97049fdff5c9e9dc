"""Scaling curves: speed-up, efficiency and throughput against ranks, measured and
extrapolated with the alpha-beta model (:mod:`labkit.measure.scaling`).

:func:`scaling_figure` draws a list of :class:`~labkit.measure.scaling.ScalingRun` records;
:class:`ScalingWidget` adds controls for the link and the model size of the extrapolation.
Every number shown comes from :mod:`labkit.measure.scaling` (the tests compare).
"""

from __future__ import annotations

from collections.abc import Sequence

import ipywidgets as W
import matplotlib.pyplot as plt
from IPython.display import display
from matplotlib.figure import Figure

from labkit.measure.scaling import LINKS, ScalingRun, efficiency, extrapolate, speedup
from labkit.models.gpt import PRESETS

__all__ = ["ScalingWidget", "scaling_figure"]


def scaling_figure(
    runs: Sequence[ScalingRun], predicted: Sequence[ScalingRun] = (), title: str = ""
) -> Figure:
    """Three panels: speed-up, efficiency % and throughput (samples/s) against ranks, each
    with the ideal line; ``predicted`` runs (e.g. :func:`extrapolate`) dashed, log axes."""
    both = list(runs) + list(predicted)
    base = [r for r in runs if r.ranks == 1]
    sp, eff = speedup(both), efficiency(both)
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.3))
    ranks = sorted(sp)
    for ax, ys, name in (
        (axes[0], sp, "speed-up"),
        (axes[1], {n: 100 * e for n, e in eff.items()}, "efficiency %"),
    ):
        meas = [r.ranks for r in runs]
        ax.plot(meas, [ys[n] for n in meas], "o-", label="measured")
        if predicted:
            pr = [1] + [r.ranks for r in predicted]
            ax.plot(pr, [ys[n] for n in pr], "s--", label="alpha-beta")
        ideal = [float(n) for n in ranks] if name == "speed-up" else [100.0] * len(ranks)
        ax.plot(ranks, ideal, ":", color="gray", label="ideal")
        ax.set_xlabel("ranks")
        ax.set_title(name)
    thr = {r.ranks: r.throughput for r in both}
    axes[2].plot([r.ranks for r in runs], [r.throughput for r in runs], "o-", label="measured")
    if predicted:
        axes[2].plot(
            [r.ranks for r in predicted],
            [r.throughput for r in predicted],
            "s--",
            label="alpha-beta",
        )
    if base:  # ideal: N times the 1-rank throughput, in both modes
        axes[2].plot(
            ranks, [base[0].throughput * n for n in ranks], ":", color="gray", label="ideal"
        )
    axes[2].set_title("throughput (samples/s)")
    axes[2].set_xlabel("ranks")
    if max(thr) > 8:
        for ax in axes:
            ax.set_xscale("log", base=2)
        axes[0].set_yscale("log", base=2)
        axes[2].set_yscale("log")
    axes[2].legend(fontsize=8)
    fig.suptitle(title or f"{runs[0].mode} scaling")
    fig.tight_layout()
    return fig


class ScalingWidget:
    """Measured runs plus the alpha-beta extrapolation to 8..1,024 GPUs for a chosen link
    and model size (gradient bytes = parameters x ``grad_bytes_per_param``)."""

    def __init__(
        self,
        runs: Sequence[ScalingRun],
        model: str = "gpt2",
        link: str = "InfiniBand NDR (50 GB/s)",
        grad_bytes_per_param: int = 2,
    ) -> None:
        if not any(r.ranks == 1 for r in runs):
            raise ValueError("ScalingWidget needs a measured 1-rank run as its baseline")
        self.runs = list(runs)
        self.grad_bytes_per_param = grad_bytes_per_param
        self.link = W.Dropdown(options=list(LINKS), value=link, description="link")
        self.model = W.Dropdown(options=list(PRESETS), value=model, description="model size")
        self.max_ranks = W.SelectionSlider(
            options=[8, 16, 32, 64, 128, 256, 512, 1024], value=1024, description="up to"
        )
        self.summary = W.HTML()
        self.plot = W.Output()
        for c in (self.link, self.model, self.max_ranks):
            c.observe(lambda _change: self.update(), names="value")
        self.widget = W.VBox(
            [W.HBox([self.link, self.model, self.max_ranks]), self.summary, self.plot]
        )
        self.widget.add_class("labkit-scaling-widget")
        self.update()

    def grad_bytes(self) -> float:
        return PRESETS[self.model.value].num_params() * self.grad_bytes_per_param

    def predicted(self) -> list[ScalingRun]:
        base = next(r for r in self.runs if r.ranks == 1)
        ranks = [n for n in (8, 16, 32, 64, 128, 256, 512, 1024) if n <= self.max_ranks.value]
        return extrapolate(base, self.grad_bytes(), LINKS[self.link.value], ranks)

    def update(self) -> None:
        pred = self.predicted()
        eff = efficiency(self.runs + pred)
        last = pred[-1].ranks
        measured = ", ".join(
            f"{n}: {100 * eff[n]:.1f}%" for n in sorted(r.ranks for r in self.runs)
        )
        self.summary.value = (
            f"measured efficiency {measured}; predicted at {last} GPUs: "
            f'<span class="labkit-scaling-eff">{100 * eff[last]:.1f}%</span>'
        )
        self.plot.clear_output(wait=True)
        with self.plot:
            fig = scaling_figure(
                self.runs,
                pred,
                f"{self.runs[0].mode} scaling, {self.model.value} over {self.link.value}",
            )
            display(fig)
            plt.close(fig)

    def _ipython_display_(self) -> None:
        display(self.widget)
