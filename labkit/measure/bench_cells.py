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

A wide spread does not make a target undecidable, only expensive: the median of ``n`` paired
ratios is known to within an interval that narrows as ``1/sqrt(n)`` whatever the spread.
``median_interval`` is that interval, distribution-free (order statistics: the number of
ratios below the true median is Binomial(n, 1/2)), and ``verdict`` reads a target from it:
met, missed, or undecided while the target lies inside the interval.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = ["NOISY", "cell", "median_interval", "ratio_and_spread", "verdict"]

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


def median_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """A ``level`` confidence interval of the median of ``values``' distribution: sorted
    ``x[j] .. x[n-1-j]`` for the largest ``j`` with ``1 - 2 P(B <= j) >= level``, where
    ``B ~ Binomial(n, 1/2)`` counts the values below the median (9 values, 95%: ``x[1] ..
    x[7]``, coverage 96.1%). Fewer than 6 values cannot reach 95%: refused."""
    n = len(values)
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    below, j = 0.0, -1  # P(B <= j)
    while j + 1 < n / 2:
        nxt = below + math.comb(n, j + 1) / 2**n
        if 1 - 2 * nxt < level:
            break
        below, j = nxt, j + 1
    if j < 0:
        raise ValueError(f"{n} values cannot bound the median at {level:.0%} confidence")
    x = sorted(values)
    return x[j], x[n - 1 - j]


def verdict(ours: Sequence[float], theirs: Sequence[float], target: float = 1.0) -> str:
    """Whether ``ours`` meets "ours / theirs <= target" (times, paired round by round), from the
    95% interval of the median per-round ``ours_i / theirs_i``."""
    lo, hi = median_interval([o / t for o, t in zip(ours, theirs, strict=True)])
    span = f"95% interval of ours/theirs {lo:.3f}x .. {hi:.3f}x over {len(ours)} pairs"
    if hi <= target:
        return f"meets ours/theirs <= {target:.2f}x ({span})"
    if lo > target:
        return f"MISSES ours/theirs <= {target:.2f}x ({span})"
    return f"undecided: {target:.2f}x lies inside the {span}; more steps narrow it"
