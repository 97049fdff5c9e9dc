"""The evidence a drill run leaves: the number in the breakdown that names each fault, and the
:class:`Mystery` that holds a run with its fault hidden (:mod:`labkit.labs.drills` runs them).

:func:`evidence` reads the category in ``SIGNATURE`` (``drills_faults.json``) from the faulty
and the clean run: the worst rank's value against the clean one, the counts that tell
(host syncs, all-reduces), or, for a slow or overloaded rank, its compute against the others'
wait in ``comm``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from labkit.labs.drills_faults import FAULTS, SIGNATURE
from labkit.profiling.breakdown import Breakdown

__all__ = ["Mystery", "evidence"]


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f} ms"


def evidence(fault: str, faulty: Sequence[Breakdown], clean: Sequence[Breakdown]) -> str:
    """The number in the breakdown that names ``fault``, read from the two runs."""
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; expected one of {FAULTS}")

    def worst(c: str, bs: Sequence[Breakdown]) -> Breakdown:
        return max(bs, key=lambda b: b.seconds[c])

    compute = [b.seconds["forward"] + b.seconds["backward"] for b in faulty]
    slow = max(range(len(faulty)), key=lambda r: compute[r] / max(faulty[r].samples, 1))
    if fault in ("starved_loader", "unpinned_copy", "checkpoint_every_step"):
        c = SIGNATURE[fault][0]
        b = worst(c, faulty)
        base = _ms(worst(c, clean).seconds[c])
        return f"'{c}' was {_ms(b.seconds[c])} per step on rank {b.rank} against {base} clean"
    if fault == "host_sync":
        n, n0 = faulty[0].counts["host syncs"], clean[0].counts["host syncs"]
        return f"'host syncs' per step was {n:g} against {n0:g} clean (aten::_local_scalar_dense)"
    if fault == "tiny_buckets":
        b = worst("comm", faulty)
        return (
            f"'all-reduces' per step was {b.counts['all-reduces']:g} against "
            f"{clean[0].counts['all-reduces']:g} clean, and 'comm' {_ms(b.seconds['comm'])} "
            f"against {_ms(worst('comm', clean).seconds['comm'])}"
        )
    if fault == "uneven_batches":  # the rank with the most work, not the slowest per sample
        slow = max(range(len(faulty)), key=lambda r: compute[r])
    others = [b for b in faulty if b.rank != faulty[slow].rank]
    wait = max(b.seconds["comm"] for b in others)
    if fault == "straggler":
        return (
            f"every rank had {faulty[0].samples} samples, yet rank {slow}'s forward+backward "
            f"took {_ms(compute[slow])} against {_ms(min(compute))}, while the others waited "
            f"in 'comm' {_ms(wait)}"
        )
    return (  # uneven_batches
        f"'samples' per rank were {[b.samples for b in faulty]}: rank {slow} computed "
        f"{_ms(compute[slow])} while the others waited in 'comm' {_ms(wait)}"
    )


class Mystery:
    """A run with one hidden fault, the clean run to compare it with, and the fixed run.

    ``breakdowns``, ``clean`` and (after a diagnosis) ``after``: one :class:`Breakdown` per
    rank. :func:`labkit.checks.drills.check_diagnosis` compares a guess with the hidden fault.
    """

    def __init__(
        self,
        faulty: list[Breakdown],
        clean: list[Breakdown],
        fault: str,
        cfg: Any,  # the DrillConfig of the faulty run
        fixed: list[Breakdown] | None = None,
    ):
        self.breakdowns, self.clean, self.cfg = faulty, clean, cfg
        self._fault, self._fixed = fault, fixed

    def __repr__(self) -> str:
        return f"Mystery(world_size={len(self.breakdowns)}, fault=<hidden>)"

    def reveal(self) -> str:
        return self._fault

    @property
    def after(self) -> list[Breakdown] | None:
        """The same run with the fault's fix applied (measured in the same launch)."""
        return self._fixed
