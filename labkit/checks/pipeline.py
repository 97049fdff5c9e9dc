"""Check for exercise 07 (1F1B as data): the learner's generator, reviewed then run.

Contract checked::

    one_f_one_b(p, m) -> list[list[Action]]   # per rank, its F and B actions in order

The check, in order, stopping at the first problem:

1. shape: p lists of ``Action("F", mb)`` / ``Action("B", mb)`` only;
2. the validator, after the standard send/receive batches are added
   (``schedules.with_communication``): names the rank, position, action and micro-batch of
   the first violation (backward before forward, a deadlock under NCCL's rules);
3. the simulator: each rank's peak stash must be 1F1B's ``min(p - r, m)`` and the bubble
   (p - 1)/(m + p - 1); the first rank whose list differs from PipeDream-Flush is named with
   the position;
4. the schedule runs on 2 real ranks (gloo) for 2 steps of a tiny GPT, and its losses must
   equal single-process gradient accumulation's.
"""

from __future__ import annotations

from collections.abc import Callable

from labkit.checks.core import CheckFailed, launch_check, passed
from labkit.pipeline.actions import Action, Schedule
from labkit.pipeline.schedules import one_f_one_b, with_communication
from labkit.pipeline.simulator import simulate
from labkit.pipeline.validator import ScheduleError

__all__ = ["check_1f1b", "review_1f1b"]

GRID = ((2, 1), (2, 4), (3, 5), (4, 8), (4, 3))  # (p, m), m < p included
RUN_P, RUN_M = 2, 4


def _as_schedule(fn: Callable[[int, int], list[list[Action]]], p: int, m: int) -> Schedule:
    orders = fn(p, m)
    if not isinstance(orders, list) or len(orders) != p:
        raise CheckFailed(
            f"p={p}, m={m}: expected a list of {p} per-rank lists, got {type(orders).__name__}"
            f" of length {len(orders) if isinstance(orders, list) else '?'}"
        )
    for r, order in enumerate(orders):
        for i, a in enumerate(order):
            if not isinstance(a, Action) or a.kind not in ("F", "B") or a.chunk != 0:
                raise CheckFailed(
                    f"p={p}, m={m}: rank {r}, position {i}: expected Action('F'|'B', mb), got {a!r}"
                )
    return with_communication("yours", p, m, 1, False, orders)


def review_1f1b(fn: Callable[[int, int], list[list[Action]]]) -> Schedule:
    """Steps 1-3 (no processes). Returns the learner's schedule at (RUN_P, RUN_M)."""
    for p, m in GRID:
        sched = _as_schedule(fn, p, m)
        try:
            res = simulate(sched)
        except ScheduleError as exc:
            raise CheckFailed(f"p={p}, m={m}: the validator rejects your schedule: {exc}") from None
        want = [min(p - r, m) for r in range(p)]
        for r in range(p):
            if res.peak_stash[r] != want[r]:
                raise CheckFailed(
                    f"p={p}, m={m}: rank {r} holds {res.peak_stash[r]} micro-batches' "
                    f"activations at its peak; 1F1B holds min(p - r, m) = {want[r]} "
                    f"(how many warm-up forwards does rank {r} run?)"
                )
        ref = one_f_one_b(p, m)
        for r in range(p):
            got, exp = [a.label() for a in sched.compute(r)], [a.label() for a in ref.compute(r)]
            i = next((i for i, (x, y) in enumerate(zip(got, exp)) if x != y), None)
            if i is not None or len(got) != len(exp):
                i = i if i is not None else min(len(got), len(exp))
                raise CheckFailed(
                    f"p={p}, m={m}: rank {r}'s list differs from 1F1B at position {i}: expected "
                    f"{exp[i] if i < len(exp) else 'the end'}, "
                    f"got {got[i] if i < len(got) else 'the end'} "
                    f"(yours: {' '.join(got)})"
                )
        bubble = (p - 1) / (m + p - 1)
        if abs(res.bubble_fraction - bubble) > 1e-9:
            raise CheckFailed(
                f"p={p}, m={m}: bubble {res.bubble_fraction:.4f}, 1F1B's is {bubble:.4f}"
            )
    return _as_schedule(fn, RUN_P, RUN_M)


def _run(sched: Schedule) -> list[float | None]:
    from labkit.pipeline.equivalence import case_for, train_pipeline

    return train_pipeline(sched, case_for(RUN_P, RUN_M))["losses"]


def check_1f1b(fn: Callable[[int, int], list[list[Action]]]) -> None:
    """Review the learner's generator, then run it on 2 ranks against the reference loss."""
    from labkit.pipeline.equivalence import case_for, train_reference

    sched = review_1f1b(fn)
    losses = launch_check(_run, sched, world_size=RUN_P, timeout=180, backend="gloo", quiet=True)[
        -1
    ]
    ref = train_reference(case_for(RUN_P, RUN_M))["losses"]
    for step, (got, want) in enumerate(zip(losses, ref)):
        if got is None or abs(got - want) > 1e-5 * abs(want):
            raise CheckFailed(
                f"step {step}: loss on the last rank {got}, single-process reference {want}"
            )
    passed(
        f"1F1B validated and simulated on {len(GRID)} (p, m) pairs; ran on {RUN_P} ranks "
        f"(m={RUN_M}), losses {[round(x, 6) for x in ref]} equal the reference's"
    )
