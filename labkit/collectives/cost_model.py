"""The alpha-beta cost model of collectives, and a least-squares fit of alpha and beta.

Hockney's model: sending one message of ``n`` bytes takes ``alpha + n * beta``, with ``alpha``
the per-message latency (seconds) and ``beta`` the inverse bandwidth (seconds per byte). A
collective that takes ``k`` sequential steps and sends ``m`` bytes per rank along its critical
path costs ``k * alpha + m * beta``. With ``p`` ranks and ``D`` bytes per rank
(Thakur, Rabenseifner & Gropp, 2005; Patarasuk & Yuan, 2009):

    algorithm                     steps k           bytes m per rank
    naive (reduce + broadcast)    2(p-1)            2(p-1) * D      <- root's link carries all
    ring all-reduce               2(p-1)            2(p-1)/p * D    <- bandwidth-optimal
    ring reduce-scatter/gather    (p-1)             (p-1)/p * D
    recursive doubling            log2 p (+2)       log2 p * D (+2D) <- latency-optimal
    binomial broadcast            ceil(log2 p)      ceil(log2 p) * D

(+2: when ``p`` is not a power of two, the extra ranks fold in and get the result back.)
Reductions' arithmetic (the ``gamma`` term) is left out: it overlaps the transfers here.

Everything in this module is a plain function of numbers: no processes, testable by hand.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

__all__ = [
    "AlphaBeta",
    "naive_all_reduce_time",
    "ring_all_reduce_time",
    "ring_reduce_scatter_time",
    "ring_all_gather_time",
    "recursive_doubling_steps",
    "recursive_doubling_time",
    "binomial_broadcast_time",
    "crossover_bytes",
    "busbw_factor",
    "fit_alpha_beta",
]


class AlphaBeta(NamedTuple):
    """Fitted link parameters: ``alpha`` seconds per message, ``beta`` seconds per byte."""

    alpha: float
    beta: float

    @property
    def bandwidth(self) -> float:
        """Bytes per second, ``1 / beta``."""
        return 1.0 / self.beta if self.beta > 0 else math.inf


def _check(nbytes: float, p: int) -> None:
    if p < 1:
        raise ValueError(f"the number of ranks p must be >= 1, got {p}")
    if nbytes < 0:
        raise ValueError(f"the message size must be >= 0 bytes, got {nbytes}")


def naive_all_reduce_time(nbytes: float, p: int, alpha: float, beta: float) -> float:
    """Reduce to a root then broadcast: ``2(p-1) * (alpha + D * beta)``."""
    _check(nbytes, p)
    return 2 * (p - 1) * (alpha + nbytes * beta)


def ring_all_reduce_time(nbytes: float, p: int, alpha: float, beta: float) -> float:
    """Ring all-reduce: ``2(p-1) * alpha + 2(p-1)/p * D * beta``."""
    _check(nbytes, p)
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes * beta


def ring_reduce_scatter_time(nbytes: float, p: int, alpha: float, beta: float) -> float:
    """Ring reduce-scatter of a ``D``-byte input: ``(p-1) * alpha + (p-1)/p * D * beta``."""
    _check(nbytes, p)
    return (p - 1) * alpha + (p - 1) / p * nbytes * beta


def ring_all_gather_time(nbytes: float, p: int, alpha: float, beta: float) -> float:
    """Ring all-gather into a ``D``-byte output: same cost as the reduce-scatter."""
    return ring_reduce_scatter_time(nbytes, p, alpha, beta)


def recursive_doubling_steps(p: int) -> int:
    """``log2 p`` for a power of two; two more (fold in, hand back) otherwise."""
    _check(0, p)
    p2 = 1 << (p.bit_length() - 1)
    return (p2.bit_length() - 1) + (0 if p == p2 else 2)


def recursive_doubling_time(nbytes: float, p: int, alpha: float, beta: float) -> float:
    """Recursive-doubling all-reduce: every step swaps the whole ``D`` bytes."""
    _check(nbytes, p)
    return recursive_doubling_steps(p) * (alpha + nbytes * beta)


def binomial_broadcast_time(nbytes: float, p: int, alpha: float, beta: float) -> float:
    """Binomial-tree broadcast: ``ceil(log2 p) * (alpha + D * beta)``."""
    _check(nbytes, p)
    return math.ceil(math.log2(p)) * (alpha + nbytes * beta) if p > 1 else 0.0


def crossover_bytes(p: int, alpha: float, beta: float) -> float:
    """Message size above which the ring all-reduce beats recursive doubling (``inf``: never).

    Solve ``2(p-1) a + 2(p-1)/p D b = k (a + D b)`` for ``D``, with ``k`` recursive-doubling steps.
    """
    k = recursive_doubling_steps(p)
    ring_steps, ring_factor = 2 * (p - 1), 2 * (p - 1) / p
    if k <= ring_factor:  # recursive doubling moves no more bytes than the ring: it always wins
        return math.inf
    return max(0.0, (ring_steps - k) * alpha / ((k - ring_factor) * beta))


def busbw_factor(op: str, p: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw * factor, algbw = S / t, S the full size.

    all_reduce: ``2(p-1)/p``; reduce_scatter and all_gather: ``(p-1)/p``; broadcast: 1. With it,
    busbw is comparable to the link's bandwidth whatever ``p``, so algorithms can be compared.
    """
    factors = {
        "all_reduce": 2 * (p - 1) / p,
        "reduce_scatter": (p - 1) / p,
        "all_gather": (p - 1) / p,
        "broadcast": 1.0,
    }
    if op not in factors:
        raise ValueError(f"unknown collective {op!r}; known: {sorted(factors)}")
    return factors[op]


def fit_alpha_beta(
    sizes: Sequence[float],
    times: Sequence[float],
    *,
    steps: float = 1.0,
    bytes_factor: float = 1.0,
) -> AlphaBeta:
    """Least-squares ``alpha, beta``: ``times[i] ~ steps * alpha + bytes_factor * sizes[i] * beta``.

    For one point-to-point message keep the defaults; for a ring all-reduce on ``p`` ranks pass
    ``steps=2(p-1), bytes_factor=2(p-1)/p`` so the fit recovers the *link's* parameters, which
    then predict other ``p`` and other algorithms. Both are clipped at 0 (noise can make the
    intercept slightly negative when latency is tiny next to the largest transfers).
    Fits on relative error (each row divided by its time) so 4 KB and 256 MB weigh alike.
    """
    x = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    if x.shape != t.shape or x.ndim != 1 or len(x) < 2:
        raise ValueError(
            f"need two equal-length 1-D sequences with >= 2 points, got {x.shape} and {t.shape}"
        )
    if np.any(t <= 0):
        raise ValueError("times must be positive")
    a = np.stack([np.full_like(x, steps), bytes_factor * x], axis=1) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    return AlphaBeta(max(float(alpha), 0.0), max(float(beta), 0.0))
