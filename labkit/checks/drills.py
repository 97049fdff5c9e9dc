"""The check behind the diagnosis drills (notebook 12): did the learner name the hidden fault?

Right or wrong, the answer comes with the number in the breakdown that should have told them
(:func:`labkit.labs.drills.evidence`, read from the learner's own run).
"""

from __future__ import annotations

from collections.abc import Callable

from labkit.checks.core import CheckFailed, passed
from labkit.labs.drills import FAULTS, SIGNATURE, Mystery, evidence
from labkit.profiling.breakdown import Breakdown

__all__ = ["check_diagnosis", "check_diagnoser", "normalise_fault", "synthetic_runs"]


def normalise_fault(guess: str) -> str:
    """``"Tiny buckets"`` -> ``"tiny_buckets"``; a clear error for a name not in the list."""
    key = str(guess).strip().lower().replace("-", "_").replace(" ", "_")
    if key not in FAULTS:
        raise ValueError(f"{guess!r} is not one of the faults: {', '.join(FAULTS)}")
    return key


def check_diagnosis(mystery: Mystery, guess: str) -> None:
    """PASSED with the evidence when ``guess`` names the hidden fault; CheckFailed otherwise."""
    key = normalise_fault(guess)
    fault = mystery.reveal()
    told = evidence(fault, mystery.breakdowns, mystery.clean)
    if key != fault:
        raise CheckFailed(
            f"not {key}: that fault would show as '{SIGNATURE[key][0]}' growing. "
            f"The number that should have told you: {told}. Look at that column again."
        )
    passed(f"{fault}. The evidence: {told}. The fix: {SIGNATURE[fault][1]}.")


def _b(
    rank: int, samples: int = 64, counts: dict[str, float] | None = None, **ms: float
) -> Breakdown:
    base = {
        "data": 1.0,
        "h2d": 0.2,
        "forward": 10.0,
        "backward": 20.0,
        "comm": 5.0,
        "optimizer": 2.0,
        "other": 0.5,
    }
    base.update(ms)
    seconds = {c: v / 1e3 for c, v in base.items()}
    return Breakdown(
        rank,
        5,
        seconds,
        sum(seconds.values()),
        samples,
        counts or {"all-reduces": 1, "host syncs": 0},
    )


def synthetic_runs() -> dict[str | None, list[Breakdown]]:
    """Two-rank breakdowns (ms) shaped like each fault, from the fault's mechanism: a fast,
    deterministic first test for a learner's diagnoser before real runs."""
    return {
        None: [_b(0), _b(1)],
        "starved_loader": [_b(0, data=60.0, comm=9.0), _b(1, data=55.0)],
        "host_sync": [
            _b(r, counts={"all-reduces": 1, "host syncs": 1}, forward=10.3) for r in (0, 1)
        ],
        "tiny_buckets": [
            _b(r, comm=120.0, counts={"all-reduces": 330, "host syncs": 0}) for r in (0, 1)
        ],
        "straggler": [_b(0, comm=65.0), _b(1, forward=40.0, backward=50.0)],
        "uneven_batches": [_b(0, comm=95.0), _b(1, 384, forward=60.0, backward=120.0, data=4.0)],
        "unpinned_copy": [_b(0, h2d=25.0), _b(1, h2d=24.0, comm=7.0)],
        "checkpoint_every_step": [
            _b(r, other=90.0, counts={"all-reduces": 1, "host syncs": 4}) for r in (0, 1)
        ],
    }


def check_diagnoser(diagnose: Callable[[list[Breakdown], list[Breakdown]], str]) -> None:
    """``diagnose(faulty, clean) -> fault name`` must name every fault of :func:`synthetic_runs`
    and call the clean run clean (``None``): the negative control."""
    runs = synthetic_runs()
    clean = runs[None]
    for fault, faulty in runs.items():
        got = diagnose(faulty, clean)
        if got != fault:
            hint = evidence(fault, faulty, clean) if fault else "nothing grew: the run is clean"
            raise CheckFailed(
                f"a run with {fault or 'no fault'} was diagnosed as {got!r}. The evidence: {hint}."
            )
    passed(f"your diagnoser names all {len(runs) - 1} faults and leaves the clean run alone")
