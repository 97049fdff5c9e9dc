"""Scaling curves: speed-up, efficiency and throughput against ranks, measured and
modeled with the alpha-beta model (:mod:`labkit.measure.scaling`).

:func:`scaling_figure` draws a list of :class:`~labkit.measure.scaling.ScalingRun` records;
:class:`ScalingWidget` adds controls for the link and the model size of the model.

Measured and modeled stay apart: the measured runs are a small CPU proxy on this machine,
and a model's step on GPUs is not that proxy's step. :func:`modeled_runs` therefore scales
the compute with the model (``6 N`` FLOPs per token at a stated peak and MFU) before adding
the model's own gradient all-reduce; each series is measured against its own 1-rank step.
Every number shown comes from these functions (the tests compare).
"""

from __future__ import annotations

from collections.abc import Sequence

import ipywidgets as W
import matplotlib.pyplot as plt
from IPython.display import display
from matplotlib.figure import Figure

from labkit.collectives.cost_model import AlphaBeta
from labkit.hardware import value
from labkit.measure.scaling import LINKS, ScalingRun, efficiency, extrapolate, speedup
from labkit.models.gpt import PRESETS, GPTConfig

__all__ = ["GPU_PEAK_FLOPS", "MODEL_MFU", "ScalingWidget", "modeled_runs", "scaling_figure"]

GPU_PEAK_FLOPS = value("a100.peak_bf16")  # A100 bf16 dense peak (hardware catalog)
MODEL_MFU = 0.4  # stated: a well-tuned data-parallel step's model FLOPs utilisation
RANKS = (8, 16, 32, 64, 128, 256, 512, 1024)


def modeled_runs(
    proxy: ScalingRun,
    cfg: GPTConfig,
    link: AlphaBeta,
    ranks: Sequence[int] = RANKS,
    *,
    peak_flops: float = GPU_PEAK_FLOPS,
    mfu: float = MODEL_MFU,
    grad_bytes_per_param: int = 2,
) -> list[ScalingRun]:
    """``cfg``'s data-parallel step on 1 and ``ranks`` GPUs, batch as in the measured ``proxy``.

    One GPU's step: ``6 N T / (peak x MFU)`` seconds, ``N`` = parameters, ``T`` = tokens
    per GPU per step = ``proxy.global_batch`` sequences x ``cfg.block_size`` (weak: per
    GPU; strong: the whole batch, split by :func:`extrapolate`). Then
    :func:`~labkit.measure.scaling.extrapolate` adds a ring all-reduce of ``N x
    grad_bytes_per_param`` bytes. The first run returned is that 1-GPU step (label
    "modeled"), so efficiency is modeled against modeled, never against the CPU proxy."""
    if proxy.ranks != 1:
        raise ValueError(f"model from the 1-rank run, got ranks={proxy.ranks}")
    if not (0 < mfu <= 1) or peak_flops <= 0:
        raise ValueError(f"need 0 < mfu <= 1 and peak_flops > 0, got {mfu=}, {peak_flops=}")
    n_params = cfg.num_params()
    compute = 6 * n_params * proxy.global_batch * cfg.block_size / (peak_flops * mfu)
    one = ScalingRun(1, compute, proxy.global_batch, proxy.mode, "modeled")
    return [one] + extrapolate(one, n_params * grad_bytes_per_param, link, ranks)


def scaling_figure(
    runs: Sequence[ScalingRun], predicted: Sequence[ScalingRun] = (), title: str = ""
) -> Figure:
    """Three panels: speed-up, efficiency % and throughput (samples/s) against ranks, each
    with the ideal line; ``predicted`` runs dashed, log axes.

    ``predicted`` with its own 1-rank run (:func:`modeled_runs`) is its own series: its
    speed-up and efficiency are against that run, and its throughput on the right axis
    panel is its own (labelled "modeled"). Without one (:func:`extrapolate` from a measured
    run) it continues the measured series, labelled "alpha-beta"."""
    both = list(runs) + list(predicted)
    base = [r for r in runs if r.ranks == 1]
    own = any(r.ranks == 1 for r in predicted)
    sp, eff = speedup(runs if own else both), efficiency(runs if own else both)
    if own:
        psp, peff = speedup(predicted), efficiency(predicted)
    else:
        psp, peff = sp, eff
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.3))
    ranks = sorted(set(sp) | set(psp))
    pname = "modeled" if own else "alpha-beta"
    for ax, ys, pys, name in (
        (axes[0], sp, psp, "speed-up"),
        (axes[1], {n: 100 * e for n, e in eff.items()}, {n: 100 * e for n, e in peff.items()},
         "efficiency %"),
    ):  # fmt: skip
        meas = [r.ranks for r in runs]
        ax.plot(meas, [ys[n] for n in meas], "o-", label="measured")
        if predicted:
            pr = sorted({1} | {r.ranks for r in predicted})
            ax.plot(pr, [pys[n] for n in pr], "s--", label=pname)
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
            label=pname,
        )
    ideal_base = [r for r in predicted if r.ranks == 1] if own else base
    if ideal_base:  # ideal: N times the 1-rank throughput (the modeled one's, if any)
        axes[2].plot(
            ranks, [ideal_base[0].throughput * n for n in ranks], ":", color="gray",
            label="ideal",
        )  # fmt: skip
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
    """Measured runs, and apart from them the chosen model's modeled step
    (:func:`modeled_runs`: compute ``6 N T`` at ``mfu`` of ``peak_flops``, plus the ring
    all-reduce of ``N x grad_bytes_per_param`` bytes) on 8..1,024 GPUs over a chosen link."""

    def __init__(
        self,
        runs: Sequence[ScalingRun],
        model: str = "gpt2",
        link: str = "InfiniBand NDR (50 GB/s)",
        grad_bytes_per_param: int = 2,
        peak_flops: float = GPU_PEAK_FLOPS,
        mfu: float = MODEL_MFU,
    ) -> None:
        if not any(r.ranks == 1 for r in runs):
            raise ValueError("ScalingWidget needs a measured 1-rank run as its baseline")
        self.runs = list(runs)
        self.grad_bytes_per_param = grad_bytes_per_param
        self.peak_flops, self.mfu = peak_flops, mfu
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
        """The modeled runs: the 1-GPU step of the chosen model first, then up to the slider."""
        base = next(r for r in self.runs if r.ranks == 1)
        ranks = [n for n in RANKS if n <= self.max_ranks.value]
        cfg = PRESETS[self.model.value]
        return modeled_runs(
            base, cfg, LINKS[self.link.value], ranks, peak_flops=self.peak_flops, mfu=self.mfu,
            grad_bytes_per_param=self.grad_bytes_per_param,
        )  # fmt: skip

    def update(self) -> None:
        pred = self.predicted()
        eff, peff = efficiency(self.runs), efficiency(pred)
        last, one = pred[-1].ranks, pred[0]
        cfg = PRESETS[self.model.value]
        measured = ", ".join(f"{n}: {100 * e:.1f}%" for n, e in sorted(eff.items()))
        self.summary.value = (
            f"<b>measured</b> on this machine (the CPU proxy, {len(self.runs)} runs), "
            f"efficiency {measured}.<br><b>modeled</b> {self.model.value} "
            f"({cfg.num_params() / 1e9:.2f}B parameters): {one.global_batch} x "
            f"{cfg.block_size} tokens {'per GPU' if one.mode == 'weak' else 'a step'} at "
            f"{100 * self.mfu:.0f}% MFU of "
            f"{self.peak_flops / 1e12:.0f} TFLOP/s = {one.step_time * 1e3:.0f} ms compute, "
            f"plus the ring all-reduce of {self.grad_bytes() / 1e9:.2f} GB; efficiency at "
            f'{last} GPUs: <span class="labkit-scaling-eff">{100 * peff[last]:.1f}%</span>'
        )
        self.plot.clear_output(wait=True)
        with self.plot:
            fig = scaling_figure(
                self.runs,
                pred,
                f"{self.runs[0].mode} scaling: measured (CPU proxy) and modeled "
                f"({self.model.value} over {self.link.value})",
            )
            display(fig)
            plt.close(fig)

    def _ipython_display_(self) -> None:
        display(self.widget)
