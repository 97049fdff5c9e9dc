#!/usr/bin/env python3
"""Render the README's pictures from real runs into docs/*.png (2-4 gloo ranks, about a minute).

    .venv/bin/python tools/render_figures.py            # all figures
    .venv/bin/python tools/render_figures.py ring zero  # some of them

Each figure comes from the same labkit functions the lessons call:

* ``ring.png``          the ring all-reduce's steps on 4 ranks (lesson 02)
* ``ddp_overlap.png``   bucketed vs overlapped DDP timelines on 2 ranks (lesson 03)
* ``zero_ledger.png``   ZeRO's measured memory ledger per stage on 2 ranks (lesson 05)
* ``memory_widget.png`` the memory widget's chart for GPT-2 1.3B (lesson 11)
* ``scaling.png``       a measured 1..2-rank scaling curve with the alpha-beta extrapolation
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DOCS = ROOT / "docs"


def _overlap_events() -> dict:
    from labkit.ddp import BucketedDDP, OverlappedDDP, timing

    return {
        "bucketed": timing.recorded_step(lambda m: BucketedDDP(m, bucket_cap_mb=4.0)),
        "overlapped": timing.recorded_step(lambda m: OverlappedDDP(m, bucket_cap_mb=4.0)),
    }


def ring() -> plt.Figure:
    from labkit.collectives.bench import plot_ring_snapshots, ring_snapshots

    return plot_ring_snapshots(ring_snapshots(world_size=4))


def ddp_overlap() -> plt.Figure:
    from labkit import launch
    from labkit.ddp import timing

    events = launch(_overlap_events, world_size=2, backend="gloo", quiet=True, timeout=180)[0]
    fig, axes = plt.subplots(2, 1, figsize=(9, 4), sharex=True)
    for ax, name in zip(axes, ("bucketed", "overlapped")):
        hidden = timing.overlap_fraction(events[name])
        timing.plot_timeline(
            events[name], ax=ax, title=f"{name}: {hidden:.0%} of all-reduce time hidden in backward"
        )
    fig.tight_layout()
    return fig


def _ledgers() -> list:
    from labkit.zero import measure_gpt

    return measure_gpt(("ddp", "zero1", "zero2", "zero3"), batch=2, steps=1)


def zero_ledger() -> plt.Figure:
    from labkit import launch
    from labkit.viz.memory_widget import memory_bars

    records = launch(_ledgers, world_size=2, backend="gloo", quiet=True, timeout=300)[0]
    bars = {}
    for rec in records:
        bars[f"{rec['stage']}\nmeasured"] = rec["at_peak"]
        bars[f"{rec['stage']}\npredicted"] = rec["predicted"]
    fig, ax = plt.subplots(figsize=(10, 3.8))
    return memory_bars(
        bars,
        None,
        "ZeRO on 2 ranks: measured ledger at the peak vs the paper's model states",
        ax=ax,
    )


def memory_widget() -> plt.Figure:
    from labkit.memory.estimate import TrainSetup, estimate
    from labkit.memory.model import STAGES
    from labkit.models import preset
    from labkit.viz.memory_widget import memory_bars

    cfg = preset("gpt2-1.3b")
    bars = {s: estimate(cfg, TrainSetup(micro_batch=1, dp=8, zero=s)).by_category() for s in STAGES}
    return memory_bars(bars, 24e9, "GPT-2 1.3B, 8 GPUs, bf16, micro-batch 1 x 2048: per-GPU memory")


def scaling() -> plt.Figure:
    from labkit.measure.scaling import LINKS, measure_scaling
    from labkit.models import preset
    from labkit.viz.scaling import GPU_PEAK_FLOPS, MODEL_MFU, modeled_runs, scaling_figure

    cfg = preset("small-lab")
    runs = measure_scaling(cfg, ranks=(1, 2), mode="weak", batch=4, steps=3)
    # measured and modeled apart: GPT-2's own compute on GPUs, not the CPU proxy's step
    pred = modeled_runs(runs[0], preset("gpt2"), LINKS["InfiniBand NDR (50 GB/s)"])
    return scaling_figure(
        runs,
        pred,
        "weak scaling: measured = small CPU proxy on this machine; modeled = GPT-2 at "
        f"{MODEL_MFU:.0%} MFU of {GPU_PEAK_FLOPS / 1e12:.0f} TFLOP/s + ring all-reduce, IB 50 GB/s",
    )


FIGURES: dict[str, Callable[[], plt.Figure]] = {
    "ring": ring,
    "ddp_overlap": ddp_overlap,
    "zero_ledger": zero_ledger,
    "memory_widget": memory_widget,
    "scaling": scaling,
}


def main(names: list[str]) -> None:
    bad = [n for n in names if n not in FIGURES]
    if bad:
        raise SystemExit(f"unknown figure(s) {bad}; choose from {sorted(FIGURES)}")
    DOCS.mkdir(exist_ok=True)
    for name in names or FIGURES:
        fig = FIGURES[name]()
        fig.savefig(DOCS / f"{name}.png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        print(f"wrote {DOCS / f'{name}.png'}")


if __name__ == "__main__":
    main(sys.argv[1:])
