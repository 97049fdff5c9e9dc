"""Replay a schedule with per-action costs: timeline, bubble fraction, peak stash.

:func:`simulate` validates the schedule (``validator``), then replays it in time
(``replay``: the executor's rules, sends eager and receives waiting, as gloo does). The
replay machinery lives one module down, in :mod:`labkit.pipeline.replay`, because the
validator needs it too (a unit-cost replay under NCCL's rules finds deadlocks); this module
re-exports it, so the imports run one way: simulator -> validator -> replay.

Costs (:class:`Costs`) are per micro-batch for one rank's whole share of the model (each of
v chunks costs 1/v of it), or, for an uneven cut (``labkit.pipeline.cut``), per unit of work
with ``Costs.stages`` giving each virtual stage's work: a stage of 3 blocks takes 3 F where
one of 2 takes 2 F, so the slowest stage paces the pipeline and the bubble follows.

Outputs: ``bubble`` per rank = 1 - busy / makespan; ``bubble_over_ideal`` = (makespan - busy)
/ busy, the form of the interleaved formula (p - 1) / (v m). ``peak_stash`` per rank = the
most (micro-batch, chunk) pairs alive at once, alive from the start of F to the end of B (or
of W when the backward is split: W still needs the stashed inputs).
"""

from __future__ import annotations

from labkit.pipeline.actions import Schedule
from labkit.pipeline.replay import (
    Costs,
    DeadlockError,
    SimResult,
    TimedAction,
    pair_ops,
    peak_stash,
    replay,
)
from labkit.pipeline.validator import validate

__all__ = [
    "Costs",
    "DeadlockError",
    "SimResult",
    "TimedAction",
    "pair_ops",
    "peak_stash",
    "replay",
    "simulate",
]


def simulate(sched: Schedule, costs: Costs | None = None) -> SimResult:
    """Validate, then replay with ``costs`` (default F = B = W = 1, no latency)."""
    validate(sched)
    return replay(sched, costs or Costs())
