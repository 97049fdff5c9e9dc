"""The pipeline bubble the planner charges, from the pipeline simulator (part 2).

The planner's closed form charges ``(p - 1) / v`` idle micro-batch slots per iteration on
top of the m slots of work: 1F1B idles ``(p - 1)(F + B)`` of ``(m + p - 1)(F + B)``, and
interleaving with v chunks per rank shrinks the warm-up and cool-down to ``(p - 1)(F + B)/v``
(Narayanan et al. 2021, section 2.2). Each slot is charged at the slowest rank's micro-batch
time, so with stages of unequal time (an uneven cut; the head on the last stage) the closed
form is an upper bound. :func:`simulated_bubble` replays the actual schedule
(``labkit.pipeline.simulate``); given each virtual stage's time (``stages``) it replays every
stage at its own time, which is what an uneven cut really idles. :func:`bubble_formula` is
the closed form; the tests show the two agree on a grid of (schedule, p, m, v) when the
stages are equal, and that the replay of an uneven cut matches the hand count.
``predict(..., bubble="simulated")`` uses the simulator.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from labkit.pipeline import Costs, Schedule, make_schedule, validate
from labkit.pipeline.simulator import replay

__all__ = ["bubble_formula", "charged_bubble", "simulated_bubble"]

# Megatron's cost split of one micro-batch through a stage: backward is twice the forward
FORWARD_SHARE = 1 / 3


def bubble_formula(p: int, v: int, per_micro: float) -> float:
    """Idle seconds per iteration of the closed form: ``per_micro (p - 1) / v``."""
    return per_micro * (p - 1) / v


@lru_cache(maxsize=256)
def _schedule(name: str, p: int, m: int, v: int) -> Schedule:
    """The validated schedule, built once (the planner replays it at many stage costs)."""
    return validate(make_schedule(name, p, m, v))


@lru_cache(maxsize=4096)
def _idle_slots(
    schedule: str, p: int, m: int, v: int, stages: tuple[float, ...] | None = None
) -> float:
    """Idle time of the busiest rank in units of its micro-batch time (F + B = 1): the
    stages' times are scaled so that the busiest rank's chunks sum to 1."""
    sched = _schedule(schedule, p, m, v)
    f = FORWARD_SHARE
    if stages is not None:
        busiest = max(sum(stages[c * p + r] for c in range(v)) for r in range(p))
        stages = tuple(w / busiest for w in stages)
    res = replay(sched, Costs(F=f, B=1 - f, W=0.0, stages=stages))  # unsplit: B + W
    return res.makespan - max(res.busy)


def simulated_bubble(
    p: int,
    m: int,
    v: int,
    per_micro: float,
    schedule: str | None = None,
    stages: Sequence[float] | None = None,
) -> float:
    """Idle seconds per iteration when ``schedule`` (default: 1F1B, or interleaved when
    v > 1) runs m micro-batches on p ranks whose busiest takes ``per_micro`` seconds a
    micro-batch. ``stages``: each virtual stage's time (any unit; only ratios count), for
    stages of unequal time; None: every rank's chunks take ``per_micro``."""
    if p == 1:
        return 0.0
    if stages is not None and len(stages) != p * v:
        raise ValueError(f"stages has {len(stages)} entries for p={p} x v={v} virtual stages")
    name = schedule or ("interleaved" if v > 1 else "1f1b")
    return per_micro * _idle_slots(name, p, m, v, None if stages is None else tuple(stages))


def charged_bubble(
    kind: str, p: int, m: int, v: int, per_micro: float, stages: Sequence[float] | None = None
) -> float:
    """The planner's bubble: ``kind`` "formula" (:func:`bubble_formula`, at the slowest
    rank's ``per_micro``) or "simulated" (:func:`simulated_bubble` with the stages' times)."""
    if kind == "formula":
        return bubble_formula(p, v, per_micro)
    if kind == "simulated":
        return simulated_bubble(p, m, v, per_micro, stages=stages)
    raise ValueError(f"bubble={kind!r}: expected 'formula' or 'simulated'")
