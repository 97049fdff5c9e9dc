"""Timing that survives a shared machine: contenders interleaved step by step, warm-up dropped,
medians reported with their spread.

Why interleave: a burst of load from another process (or another rank on the same cores) hits
whichever contender is running. Timing A's ten steps and then B's ten lets one burst land on A
alone; alternating A, B, A, B ... (and alternating who goes first in each round) spreads it over
both. Why the median: it ignores the few steps a burst slows down; the min and max are shown so
that a reader can see how noisy a number is.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["Spread", "interleaved_times", "spread"]


@dataclass(frozen=True)
class Spread:
    """Seconds: the minimum, median and maximum of repeated measurements, and their count."""

    min: float
    median: float
    max: float
    n: int

    def __str__(self) -> str:
        return (
            f"{self.median * 1e3:.2f} ms "
            f"(min {self.min * 1e3:.2f}, max {self.max * 1e3:.2f}, n={self.n})"
        )


def spread(samples: list[float]) -> Spread:
    if not samples:
        raise ValueError("spread() needs at least one sample")
    return Spread(min(samples), statistics.median(samples), max(samples), len(samples))


def interleaved_times(
    fns: Mapping[str, Callable[[], object]],
    steps: int,
    warmup: int = 2,
    *,
    sync: Callable[[], object] | None = None,
    alternate: bool = True,
) -> dict[str, list[float]]:
    """Seconds per call of each ``fns[name]()``, run round-robin for ``warmup + steps`` rounds.

    The first ``warmup`` rounds are dropped. ``sync`` (e.g. ``torch.cuda.synchronize`` or a
    barrier) runs before each timed call starts and before its clock stops, so asynchronous
    work is inside the measurement. With ``alternate``, odd rounds run the contenders in
    reverse order, so neither always goes first.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for round_ in range(warmup + steps):
        order = names[::-1] if alternate and round_ % 2 else names
        for name in order:
            if sync is not None:
                sync()
            start = time.perf_counter()
            fns[name]()
            if sync is not None:
                sync()
            if round_ >= warmup:
                times[name].append(time.perf_counter() - start)
    return times
