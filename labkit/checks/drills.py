"""The check behind the diagnosis drills (notebook 12): did the learner name the hidden fault?

Right or wrong, the answer comes with the number in the breakdown that should have told them
(:func:`labkit.labs.drills.evidence`, read from the learner's own run).
"""

from __future__ import annotations

from labkit.checks.core import CheckFailed, passed
from labkit.labs.drills import FAULTS, SIGNATURE, Mystery, evidence

__all__ = ["check_diagnosis", "normalise_fault"]


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
