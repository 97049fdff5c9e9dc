"""The cells of the collectives benchmark's table: a ratio, its spread, and when to distrust it.

Per round ``i``, ours and torch's ran back to back (interleaved, alternating who went first),
so a burst of load from another process hits both alike. The round's ratio is therefore

    r_i = torch_time_i / ours_time_i        (> 1: ours is faster)

and a cell reports ``median(r_i)`` with its spread

    spread = (p90(r) - p10(r)) / median(r)

(``statistics.quantiles(method="inclusive")``: with 5 rounds, p10 and p90 sit 40% of the way
from the extremes toward their neighbours, so a single wild round still shows; more rounds
make the deciles robust to it).
A spread above ``NOISY`` (30%) means the rounds disagree by more than most differences worth
reporting, and the cell says ``noisy (spread N%)`` instead of a ratio: rerun when quieter.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = ["NOISY", "cell", "ratio_and_spread"]

NOISY = 0.30  # a cell whose rounds spread wider than this prints no ratio


def ratio_and_spread(ours: Sequence[float], theirs: Sequence[float]) -> tuple[float, float]:
    """``(median r, (p90 - p10)/median r)`` of the per-round ratios ``r_i = theirs_i / ours_i``."""
    if len(ours) != len(theirs) or not ours:
        raise ValueError(
            f"need the same non-zero number of rounds, got {len(ours)} ours, {len(theirs)} theirs"
        )
    if min(ours) <= 0 or min(theirs) <= 0:
        raise ValueError(f"times must be positive, got min {min(ours)} and {min(theirs)}")
    r = [t / o for o, t in zip(ours, theirs, strict=True)]
    median = statistics.median(r)
    if len(r) == 1:
        return median, 0.0
    deciles = statistics.quantiles(r, n=10, method="inclusive")  # 9 cut points: p10 .. p90
    return median, (deciles[-1] - deciles[0]) / median


def cell(ratio: float, spread: float, width: int = 12, noisy: float = NOISY) -> str:
    """``'1.23x (8%)'`` (ratio, spread) right-aligned in ``width``, or ``'noisy (spread 41%)'``
    when the spread exceeds ``noisy``."""
    text = f"noisy (spread {spread:.0%})" if spread > noisy else f"{ratio:.2f}x ({spread:.0%})"
    return f"{text:>{width}}"
