"""The memory-accounting widget: per-GPU bytes by category against the card's capacity.

A thin view over :func:`labkit.memory.estimate.estimate`: every number it shows is that
function's output for the controls' setting (the tests move a control and compare). When a
measured ledger is at hand (:func:`labkit.zero.measure` records), the chart puts measured
next to predicted.
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as W
import matplotlib.pyplot as plt
from IPython.display import display
from matplotlib.figure import Figure

from labkit.memory.estimate import CATEGORIES, GB, PRECISIONS, MemoryEstimate, TrainSetup, estimate
from labkit.memory.model import RECOMPUTE, STAGES
from labkit.models.gpt import PRESETS, GPTConfig

__all__ = [
    *("CAPACITIES", "COLORS", "MemoryWidget", "fmt_gb", "memory_bars", "selective_note"),
    "verdict",
]

CAPACITIES = {"24 GB": 24e9, "40 GB": 40e9, "80 GB": 80e9, "141 GB": 141e9, "custom": None}
COLORS = dict(zip(CATEGORIES, ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8c8c8c")))
DEGREES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def fmt_gb(nbytes: float) -> str:
    """The one format of a byte count on screen: GB (1e9 bytes), two decimals."""
    return f"{nbytes / GB:.2f} GB"


def verdict(est: MemoryEstimate, capacity: float) -> str:
    """'fits' or 'does not fit', and by how much."""
    room = est.headroom(capacity)
    if room >= 0:
        return f"fits: {fmt_gb(est.total)} of {fmt_gb(capacity)}, {fmt_gb(room)} to spare"
    return f"does not fit: {fmt_gb(est.total)} needed, {fmt_gb(-room)} over {fmt_gb(capacity)}"


def memory_bars(
    bars: dict[str, dict[str, float]],
    capacity: float | None = None,
    title: str = "",
    ax: Any = None,
) -> Figure:
    """Stacked bars (one per label) of ``{category: bytes}``, with the capacity line."""
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 3.6))
    else:
        fig = ax.figure
    labels = list(bars)
    bottom = [0.0] * len(labels)
    for cat in CATEGORIES + ("temporaries",):
        vals = [bars[lbl].get(cat, 0.0) / GB for lbl in labels]
        if any(vals):
            ax.bar(
                labels,
                vals,
                bottom=bottom,
                label=cat.replace("_", " "),
                color=COLORS.get(cat, "#b0b0b0"),
            )
            bottom = [b + v for b, v in zip(bottom, vals)]
    if capacity:
        ax.axhline(capacity / GB, color="black", ls="--", lw=1.2)
        ax.text(
            len(labels) - 0.5,
            capacity / GB,
            f" capacity {fmt_gb(capacity)}",
            va="bottom",
            ha="right",
        )
        ax.set_ylim(0, max(max(bottom), capacity / GB) * 1.15)
    ax.set_ylabel("GB per GPU")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


WIDE = {"description_width": "initial"}  # the whole label, never "GPU mem..."


def _int(desc: str, value: int, lo: int = 1, hi: int = 1 << 20) -> W.BoundedIntText:
    return W.BoundedIntText(
        value=value, min=lo, max=hi, description=desc, layout=W.Layout(width="170px")
    )


def selective_note(cfg: GPTConfig, setup: TrainSetup) -> str:
    """Why "selective" recompute saves nothing here, or "" when it does save.

    Selective recompute (Korthikanti et al.) drops only the ``5 a s^2 b`` attention core
    (scores, softmax, dropout mask). SDPA's fused kernels never store that core, so under
    ``attention="sdpa"`` the estimate is the same with or without "selective"."""
    if setup.recompute != "selective" or cfg.attention != "sdpa":
        return ""
    return (
        "selective recompute changes nothing here: it drops only the attention core "
        "(scores, softmax, mask: 5as<sup>2</sup>b bytes), and SDPA's fused attention never stores "
        "that core in the first place. Choose <i>full</i> to recompute whole blocks."
    )


class MemoryWidget:
    """Controls for model, micro-batch, dp/tp/pp, ZeRO, precision, recompute, SP, offload and
    capacity; a stacked bar chart, a fits / does-not-fit line and a table, all from
    :func:`~labkit.memory.estimate.estimate`. Display it as the last expression of a cell.

    ``measured``: optional ``{label: {category: bytes}}`` bars shown beside the prediction.
    """

    def __init__(
        self,
        preset: str = "gpt2-1.3b",
        measured: dict[str, dict[str, float]] | None = None,
        capacity: str = "80 GB",
        **setup: Any,
    ) -> None:
        s = TrainSetup(**setup)
        cfg = PRESETS[preset]
        self.measured = measured or {}
        self._base = cfg
        self.preset = W.Dropdown(options=[*PRESETS, "custom"], value=preset, description="model")
        self.layers, self.hidden = _int("layers", cfg.n_layer), _int("hidden", cfg.n_embd)
        self.heads, self.vocab = _int("heads", cfg.n_head), _int("vocab", cfg.vocab_size)
        self.seq = _int("sequence", s.seq or cfg.block_size)
        self.micro_batch = W.IntSlider(
            value=s.micro_batch, min=1, max=64, description="micro-batch", style=WIDE
        )
        self.dp = W.Dropdown(
            options=DEGREES, value=s.dp, description="dp", layout=W.Layout(width="150px")
        )
        self.tp = W.Dropdown(
            options=DEGREES[:5], value=s.tp, description="tp", layout=W.Layout(width="150px")
        )
        self.pp = W.Dropdown(
            options=DEGREES[:6], value=s.pp, description="pp", layout=W.Layout(width="150px")
        )
        self.zero = W.Dropdown(options=list(STAGES), value=s.zero, description="ZeRO")
        self.precision = W.Dropdown(
            options=list(PRECISIONS), value=s.precision, description="precision"
        )
        self.recompute = W.ToggleButtons(
            options=list(RECOMPUTE), value=s.recompute, description="recompute", style=WIDE
        )
        self.sp = W.Checkbox(value=s.sp, description="sequence parallel")
        self.offload = W.Checkbox(value=s.offload_optimizer, description="optimizer on CPU")
        self.capacity = W.Dropdown(
            options=list(CAPACITIES), value=capacity, description="GPU memory", style=WIDE
        )
        self.custom_gb = W.FloatText(
            value=48.0, description="custom GB", layout=W.Layout(width="170px"), style=WIDE
        )
        self.total = W.HTML()
        self.message = W.HTML()
        self.table = W.HTML()
        self.plot = W.Output()
        self._syncing = False
        controls = [
            *(self.preset, self.layers, self.hidden, self.heads, self.vocab, self.seq),
            *(self.micro_batch, self.dp, self.tp, self.pp, self.zero, self.precision),
            *(self.recompute, self.sp, self.offload, self.capacity, self.custom_gb),
        ]
        for c in controls:
            c.observe(self._changed, names="value")
        shape = W.HBox([self.layers, self.hidden, self.heads, self.vocab, self.seq])
        grid = W.HBox([self.dp, self.tp, self.pp, self.zero])
        rows = [W.HBox([self.preset, self.micro_batch]), shape, grid]
        rows += [W.HBox([self.precision, self.sp, self.offload]), self.recompute]
        rows += [W.HBox([self.capacity, self.custom_gb]), self.total, self.message]
        self.widget = W.VBox([*rows, self.plot, self.table])
        self.widget.add_class("labkit-memory-widget")
        self.update()

    # ------------------------------------------------------------------ the model of the view
    def config(self) -> GPTConfig:
        base = PRESETS.get(self.preset.value, self._base)  # custom: the last preset's other fields
        return base.with_(
            n_layer=self.layers.value,
            n_embd=self.hidden.value,
            n_head=self.heads.value,
            vocab_size=self.vocab.value,
            block_size=max(base.block_size, self.seq.value),
        )

    def setup(self) -> TrainSetup:
        return TrainSetup(
            micro_batch=self.micro_batch.value,
            seq=self.seq.value,
            dp=self.dp.value,
            tp=self.tp.value,
            pp=self.pp.value,
            zero=self.zero.value,
            precision=self.precision.value,
            recompute=self.recompute.value,
            sp=self.sp.value,
            offload_optimizer=self.offload.value,
        )

    def capacity_bytes(self) -> float:
        fixed = CAPACITIES[self.capacity.value]
        return fixed if fixed is not None else self.custom_gb.value * GB

    def estimate(self) -> MemoryEstimate:
        return estimate(self.config(), self.setup())

    # ------------------------------------------------------------------ events and drawing
    def _changed(self, change: dict[str, Any]) -> None:
        if self._syncing:
            return
        if change["owner"] is self.preset and change["new"] in PRESETS:
            cfg = self._base = PRESETS[change["new"]]
            self._syncing = True  # fill the shape fields without redrawing five times
            try:
                for w, v in (
                    (self.layers, cfg.n_layer),
                    (self.hidden, cfg.n_embd),
                    (self.heads, cfg.n_head),
                    (self.vocab, cfg.vocab_size),
                    (self.seq, cfg.block_size),
                ):
                    w.value = v
            finally:
                self._syncing = False
        elif change["owner"] in (self.layers, self.hidden, self.heads, self.vocab, self.seq):
            self._syncing = True
            self.preset.value = "custom"
            self._syncing = False
        self.update()

    def update(self) -> None:
        try:
            est = self.estimate()
        except ValueError as e:  # e.g. tp does not divide the heads: say so, keep the controls
            # and clear the table and chart: numbers of the previous setting would read as
            # this one's
            self.total.value = '<b>total per GPU: <span class="labkit-mem-total">-</span></b>'
            self.message.value = (
                f'<span class="labkit-mem-error" style="color:#c44e52">cannot estimate this '
                f"setting: {html.escape(str(e))}. Change it and the table and chart return."
                "</span>"
            )
            self.table.value = ""
            self.plot.clear_output()
            return
        cap = self.capacity_bytes()
        self.total.value = (
            f'<b>total per GPU: <span class="labkit-mem-total">{fmt_gb(est.total)}</span></b>'
        )
        color = "#2e7d32" if est.fits(cap) else "#c62828"
        host = (
            f" (+ {fmt_gb(est.host_bytes)} of optimizer state in CPU memory)"
            if est.host_bytes
            else ""
        )
        note = selective_note(self.config(), self.setup())
        self.message.value = f'<span style="color:{color}">{verdict(est, cap)}</span>{host}' + (
            f'<br><span class="labkit-mem-note">{note}</span>' if note else ""
        )
        rows = "".join(
            f"<tr><td>{c.replace('_', ' ')}</td><td style='text-align:right'>{fmt_gb(v)}</td></tr>"
            for c, v in est.by_category().items()
        )
        self.table.value = (
            f"<table class='labkit-mem-table'>{rows}<tr><td><b>total</b></td>"
            f"<td style='text-align:right'><b>{fmt_gb(est.total)}</b></td></tr></table>"
            f"<small>workspace includes a stated allowance of {fmt_gb(est.allowance)}; "
            f"{est.params_per_gpu:,} parameters per GPU before ZeRO</small>"
        )
        s = self.setup()
        bars = {
            f"{st}{' *' if st == s.zero else ''}": estimate(
                self.config(), s.with_(zero=st)
            ).by_category()
            for st in STAGES
        }
        bars.update(self.measured)
        self.plot.clear_output(wait=True)
        with self.plot:
            fig = memory_bars(
                bars,
                cap,
                f"dp={s.dp} tp={s.tp} pp={s.pp}, {s.precision}, recompute {s.recompute} (* chosen)",
            )
            display(fig)
            plt.close(fig)

    def _ipython_display_(self) -> None:
        display(self.widget)
