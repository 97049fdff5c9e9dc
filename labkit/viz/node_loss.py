"""The node-loss drill in one picture (numbers from :mod:`labkit.labs.node_loss_report`).

Left: the loss per step across the failure: the run (before the kill on the old layout, after
it on the new one), the uninterrupted run from the same checkpoint on the new layout (dashed)
and a wrong restart that let the global batch shrink (dotted). Right: the seconds from the kill
to the first new step, one bar per phase.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

__all__ = ["plot_node_loss"]


def plot_node_loss(
    losses: Sequence[float],
    resume_step: int,
    kill_step: int,
    uninterrupted: Sequence[float],
    wrong: Sequence[float],
    timeline: Sequence[tuple[float, str]],
) -> Figure:
    """``losses[s]``: step ``s``'s loss; ``uninterrupted`` / ``wrong`` start at ``resume_step``;
    ``timeline``: ``(seconds after the kill, event)`` in order, the kill first."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.4), gridspec_kw={"width_ratios": [3, 2]})
    steps = list(range(len(losses)))
    ax.plot(steps, losses, "o-", label="the run (dp shrinks at the restart)")
    after = list(range(resume_step, resume_step + len(uninterrupted)))
    ax.plot(after, uninterrupted, "--", lw=2.5, alpha=0.7,
            label="uninterrupted from the checkpoint, new layout")  # fmt: skip
    ax.plot(after, wrong, ":", label="wrong restart: global batch shrank")
    ax.axvline(kill_step, color="crimson", lw=1)
    ax.annotate("node killed", (kill_step, max(losses)), color="crimson", fontsize=8,
                xytext=(4, -4), textcoords="offset points", va="top")  # fmt: skip
    ax.axvspan(resume_step, kill_step, color="grey", alpha=0.15, label="steps redone")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=7)
    names = [what for _, what in timeline[1:]]
    starts = [t for t, _ in timeline[:-1]]
    widths = [b - a for (a, _), (b, _) in zip(timeline, timeline[1:])]
    bx.barh(range(len(names)), widths, left=starts, color="tab:orange")
    bx.set_yticks(range(len(names)), [f"until {n}" for n in names], fontsize=7)
    bx.invert_yaxis()
    bx.set_xlabel("seconds after the kill")
    bx.set_title("from the kill to the first new step", fontsize=9)
    fig.tight_layout()
    return fig
