"""Pictures of ring attention: a timeline drawn from a real trace of labkit's ring.

One row per rank; per ring step a bar for the block compute (from "compute" to "computed")
and a thin bar under it for the transfer in flight (from "post" to its wait returning), forward
in blue, backward in orange. The transfer bar starting *before* the compute bar is the
overlap: the next K/V block travels while this one is computed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["draw_ring_trace"]

_COLOURS = {"fwd": "tab:blue", "bwd": "tab:orange"}


def _spans(events: list[tuple[str, int, str, float]]) -> list[tuple[str, int, str, float, float]]:
    """(phase, step, "compute"|"transfer", start, end) from one rank's events."""
    at = {(ph, st, what): t for ph, st, what, t in events}
    out = []
    for (ph, st, what), t in at.items():
        if what == "compute" and (ph, st, "computed") in at:
            out.append((ph, st, "compute", t, at[(ph, st, "computed")]))
        if what == "post":
            end = at.get((ph, st, "waited"), at.get((ph, st, "computed"), t))
            out.append((ph, st, "transfer", t, max(end, t)))
    return out


def draw_ring_trace(
    per_rank: list[list[tuple[str, int, str, float]]], ax: Any = None,
    colours: dict[str, str] | None = None, title: str | None = None,
) -> Any:  # fmt: skip
    """``per_rank[r]``: rank r's ``RingStats.events`` (seconds from a common barrier).
    ``colours``: one per phase (default forward/backward); ``title``. Returns the figure."""
    colours = colours or _COLOURS
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.9 * len(per_rank) + 1.2))
    for r, events in enumerate(per_rank):
        for ph, st, kind, t0, t1 in _spans(events):
            y, hgt = (r + 0.35, 0.45) if kind == "compute" else (r + 0.1, 0.18)
            ax.broken_barh([(t0 * 1e3, (t1 - t0) * 1e3)], (y, hgt), color=colours[ph],
                           alpha=0.9 if kind == "compute" else 0.45)  # fmt: skip
            if kind == "compute":
                ax.text((t0 + t1) / 2 * 1e3, y + hgt / 2, str(st), ha="center", va="center",
                        fontsize=7, color="white")  # fmt: skip
    ax.set_yticks(
        [r + 0.45 for r in range(len(per_rank))], [f"rank {r}" for r in range(len(per_rank))]
    )
    ax.set_xlabel("ms since the common barrier")
    ax.set_title(title or "ring attention: compute (thick, step number) over K/V transfer (thin)")
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=c, label=p) for p, c in colours.items()], loc="upper right",
              fontsize=8)  # fmt: skip
    return ax.figure
