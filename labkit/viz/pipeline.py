"""Pipeline pictures: a schedule's timeline (simulated or measured) and the schedule widget."""

from __future__ import annotations

from typing import Any

from labkit.pipeline.simulator import TimedAction

__all__ = ["draw_timeline", "schedule_widget"]

COLORS = {"F": "#4c78a8", "B": "#59a14f", "W": "#b07aa1"}


LABELS = {"F": "F: forward", "B": "B: backward (input grad)", "W": "W: weight grad"}


def _legend(ax: Any, kinds: set[str]) -> None:
    """A legend for the kinds drawn, outside the bars (right of the axes) so it hides none.

    A schedule without W actions (B there is the full backward) gets ``B: backward``."""
    from matplotlib.patches import Patch

    labels = dict(LABELS, B="B: backward" if "W" not in kinds else LABELS["B"])
    handles = [Patch(color=COLORS[k], label=labels[k]) for k in ("F", "B", "W") if k in kinds]
    handles.append(Patch(facecolor="white", edgecolor="grey", label="gap: bubble (idle)"))
    ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False
    )


def draw_timeline(
    timeline: list[TimedAction], title: str = "", ax: Any = None, unit: str = ""
) -> Any:
    """One row per rank, one bar per compute action (F blue, B green, W purple), micro-batch
    number inside; gaps are the bubble; a legend names the colours. Returns the figure."""
    import matplotlib.pyplot as plt

    if ax is None:
        ranks = max(t.rank for t in timeline) + 1
        fig, ax = plt.subplots(figsize=(11, 0.45 * ranks + 1.0))
    else:
        fig = ax.figure
    t0 = min(t.start for t in timeline)
    for t in timeline:
        if not t.action.is_compute:
            continue
        ax.barh(
            t.rank,
            t.end - t.start,
            left=t.start - t0,
            color=COLORS[t.action.kind],
            edgecolor="white",
        )
        ax.text(
            (t.start + t.end) / 2 - t0,
            t.rank,
            str(t.action.mb),
            ha="center",
            va="center",
            color="white",
            fontsize=7,
        )
    _legend(ax, {t.action.kind for t in timeline if t.action.is_compute})
    ax.set_yticks(sorted({t.rank for t in timeline}))
    ax.set_yticklabels([f"rank {r}" for r in sorted({t.rank for t in timeline})])
    ax.invert_yaxis()
    ax.set_xlabel(f"time {unit}".strip())
    ax.set_title(title, fontsize=10)
    return fig


def schedule_widget() -> Any:
    """Choose the schedule, p, m, v and the relative costs; the simulated timeline and its
    bubble redraw on every change (an invalid choice prints the validator's reason)."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    from labkit.pipeline import Costs, make_schedule, simulate

    name = w.Dropdown(
        options=["gpipe", "1f1b", "interleaved", "zb-h1"], value="1f1b", description="schedule"
    )
    p = w.IntSlider(4, 1, 8, description="p")
    m = w.IntSlider(8, 1, 32, description="m")
    v = w.IntSlider(2, 1, 4, description="v")
    f, b, wt = (
        w.FloatSlider(1.0, min=0.1, max=3.0, step=0.1, description=d) for d in ("F", "B", "W")
    )
    lat = w.FloatSlider(0.0, min=0.0, max=2.0, step=0.05, description="latency")
    out = w.Output()

    def redraw(_: Any = None) -> None:
        with out:
            out.clear_output(wait=True)
            try:
                s = make_schedule(
                    name.value, p.value, m.value, v.value if name.value == "interleaved" else 1
                )
                res = simulate(s, Costs(f.value, b.value, wt.value, lat.value))
            except ValueError as exc:
                print(exc)
                return
            print(
                f"bubble {res.bubble_fraction:.1%} of the time, "
                f"{res.bubble_over_ideal:.1%} of ideal; "
                f"peak stash per rank {res.peak_stash}"
            )
            fig = draw_timeline(res.timeline, f"{s.name} p={s.p} m={s.m} v={s.v}")
            plt.show(fig)

    for c in (name, p, m, v, f, b, wt, lat):
        c.observe(redraw, names="value")
    redraw()
    box = w.VBox([w.HBox([name, p, m, v]), w.HBox([f, b, wt, lat]), out])
    display(box)
    return box
