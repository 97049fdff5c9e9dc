"""Measured pipeline timelines: from each rank's recorded actions to a bubble and fitted costs.

The executor records, per rank, ``(action, start, end)`` in seconds since the step's barrier.
:func:`measured` turns all ranks' records into the simulator's ``TimedAction`` list (so the
same drawing shows both); :func:`fitted_costs` takes the median F, B and W durations (per
rank's whole share, i.e. times v) and the median transfer latency so the simulator can replay
the same schedule at the costs this machine actually showed; :func:`measured_bubble` is
1 - busy / makespan, averaged over ranks, the simulator's definition.
"""

from __future__ import annotations

import statistics
from typing import Any

from labkit.pipeline.actions import Schedule
from labkit.pipeline.simulator import Costs, TimedAction, pair_ops

__all__ = ["fitted_costs", "measured", "measured_bubble"]


def measured(timelines: list[list[tuple[Any, float, float]]]) -> list[TimedAction]:
    """Every rank's records as one list (rank = index in ``timelines``)."""
    return [TimedAction(r, a, s, e) for r, tl in enumerate(timelines) for a, s, e in tl]


def measured_bubble(timeline: list[TimedAction]) -> float:
    """Idle share of the makespan, averaged over ranks (compute actions count as busy)."""
    ranks = sorted({t.rank for t in timeline})
    start = min(t.start for t in timeline)
    makespan = max(t.end for t in timeline) - start
    busy = [
        sum(t.end - t.start for t in timeline if t.rank == r and t.action.is_compute) for r in ranks
    ]
    return sum(1 - b / makespan for b in busy) / len(busy)


def fitted_costs(timeline: list[TimedAction], sched: Schedule) -> Costs:
    """Median durations of F, B and W (for a rank's whole share; without W the whole backward
    is in B), and the median transfer latency as the simulator defines it: a receive ends at
    ``max(its post, the matching send's post) + latency``, so each receive measures
    ``end - max(both posts)`` (waiting for the partner is the replay's job, not the cost's)."""

    def med(kind: str) -> float:
        d = [t.end - t.start for t in timeline if t.action.kind == kind]
        return statistics.median(d) * sched.v if d else 0.0

    when = {(t.rank, t.action): t for t in timeline if not t.action.is_compute}
    lat = []
    for (r, i), (q, j) in pair_ops(sched).items():
        mine, theirs = when.get((r, sched.ranks[r][i])), when.get((q, sched.ranks[q][j]))
        if mine is not None and theirs is not None and mine.action.kind.startswith("RECV"):
            lat.append(max(0.0, mine.end - max(mine.start, theirs.start)))
    return Costs(F=med("F"), B=med("B"), W=med("W"), latency=statistics.median(lat) if lat else 0.0)
