"""The pipeline bubble the planner charges, from the pipeline simulator (part 2).

The planner's closed form charges ``(p - 1) / v`` idle micro-batch slots per iteration on
top of the m slots of work: 1F1B idles ``(p - 1)(F + B)`` of ``(m + p - 1)(F + B)``, and
interleaving with v chunks per rank shrinks the warm-up and cool-down to ``(p - 1)(F + B)/v``
(Narayanan et al. 2021, section 2.2). :func:`simulated_bubble` replays the actual schedule
(``labkit.pipeline.simulate``) with the planner's per-micro-batch stage time, so the number
comes from the schedule that would run; :func:`bubble_formula` is the closed form, and the
tests show the two agree on a grid of (schedule, p, m, v). ``predict(..., bubble="simulated")``
uses the simulator.
"""

from __future__ import annotations

from functools import lru_cache

from labkit.pipeline import Costs, make_schedule, simulate

__all__ = ["bubble_formula", "simulated_bubble"]

# Megatron's cost split of one micro-batch through a stage: backward is twice the forward
FORWARD_SHARE = 1 / 3


def bubble_formula(p: int, v: int, per_micro: float) -> float:
    """Idle seconds per iteration of the closed form: ``per_micro (p - 1) / v``."""
    return per_micro * (p - 1) / v


@lru_cache(maxsize=4096)
def _idle_slots(schedule: str, p: int, m: int, v: int) -> float:
    """Idle time of the busiest rank in units of one micro-batch's stage time (F + B = 1)."""
    sched = make_schedule(schedule, p, m, v)
    f = FORWARD_SHARE
    res = simulate(sched, Costs(F=f, B=1 - f, W=0.0))  # unsplit backward costs B + W
    return res.makespan - max(res.busy)


def simulated_bubble(
    p: int, m: int, v: int, per_micro: float, schedule: str | None = None
) -> float:
    """Idle seconds per iteration when ``schedule`` (default: 1F1B, or interleaved when
    v > 1) runs m micro-batches of ``per_micro`` seconds on p stages."""
    if p == 1:
        return 0.0
    name = schedule or ("interleaved" if v > 1 else "1f1b")
    return per_micro * _idle_slots(name, p, m, v)
