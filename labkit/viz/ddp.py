"""Pictures for notebook 03 (DDP from scratch): the overlap timeline of one training step."""

from __future__ import annotations

from typing import Any

from labkit.ddp.base import Event


def plot_timeline(events: list[Event], ax: Any = None, title: str = "") -> Any:
    """Backward on the top row, one row per bucket all-reduce below it (milliseconds).

    ``events`` is a wrapper's :attr:`~labkit.ddp.DataParallel.events` after one step recorded
    with ``record_events=True`` (see :func:`labkit.ddp.timing.recorded_step`). Returns ``ax``.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.4 * len(events) + 1))
    t0 = min(e.start for e in events)
    for row, e in enumerate(events):
        color = "tab:blue" if e.kind == "backward" else "tab:orange"
        ax.barh(row, (e.end - e.start) * 1e3, left=(e.start - t0) * 1e3, color=color)
    ax.set_yticks(range(len(events)), [e.name for e in events])
    ax.invert_yaxis()
    ax.set_xlabel("ms since backward started")
    ax.set_title(title)
    return ax
