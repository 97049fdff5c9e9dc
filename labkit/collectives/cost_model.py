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

Two link classes (``n`` nodes of ``k`` ranks, ``p = n k``; ``i``: inside a node, ``e``: between
nodes, ``m`` NICs per node shared by the node's flows):

    flat ring over node-ordered ranks   2(p-1) (alpha + D/p beta), each step at the slower link
    hierarchical (hierarchical.py)      2(k-1) alpha_i + 2(k-1)/k D beta_i
                                        + 2(n-1) alpha_e + 2(n-1)/n D/k beta_e * ceil(k/m)

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
    "hierarchical_all_reduce_time",
    "flat_ring_two_level_time",
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


Link = tuple[float, float]  # (alpha, beta); an AlphaBeta is one


def _check_two_level(nbytes: float, nodes: int, ranks_per_node: int, nics_per_node: int) -> None:
    for name, v in (("nodes", nodes), ("ranks_per_node", ranks_per_node)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if nics_per_node < 1:
        raise ValueError(f"nics_per_node must be >= 1, got {nics_per_node}")
    _check(nbytes, nodes * ranks_per_node)


def hierarchical_all_reduce_time(
    nbytes: float,
    nodes: int,
    ranks_per_node: int,
    intra: Link,
    inter: Link,
    nics_per_node: int = 1,
) -> float:
    """Two-level all-reduce of ``D = nbytes`` per rank on ``n = nodes`` nodes of ``k`` ranks.

    Ring reduce-scatter inside the node, ring all-reduce of the ``D/k`` chunk across nodes,
    ring all-gather inside the node::

        2(k-1) alpha_i + 2(k-1)/k D beta_i  +  2(n-1) alpha_e + 2(n-1)/n (D/k) beta_e ceil(k/m)

    The ``k`` cross-node flows of a node run at once and share its ``m`` NICs, each flow at
    ``1 / ceil(k/m)`` of a NIC's bandwidth. One NIC (``m = 1``): the node's uplink carries
    ``2(n-1)/n D`` bytes, the bandwidth term is ``2(n-1)/n D beta_e``. One NIC per rank
    (``m = k``): ``k`` times less. ``nodes = 1`` is the ring all-reduce on the intra link.
    """
    _check_two_level(nbytes, nodes, ranks_per_node, nics_per_node)
    k, n = ranks_per_node, nodes
    (ai, bi), (ae, be) = intra, inter
    sharing = -(-k // nics_per_node)  # flows per NIC: each sees 1/sharing of its bandwidth
    # reduce-scatter + all-gather inside the node = a ring all-reduce's cost on k ranks
    inside = ring_all_reduce_time(nbytes, k, ai, bi)
    across = ring_all_reduce_time(nbytes / k, n, ae, be * sharing)
    return inside + across


def flat_ring_two_level_time(
    nbytes: float,
    nodes: int,
    ranks_per_node: int,
    intra: Link,
    inter: Link,
    nics_per_node: int = 1,
) -> float:
    """A flat ring all-reduce over ``p = n k`` node-ordered ranks on the same two link classes.

    Each of its ``2(p-1)`` steps moves ``D/p`` bytes over every hop at once and ends when the
    slowest does. A ring over node-ordered ranks crosses each node edge once, but NCCL runs
    several rings at once (channels), each with its share of the data, and on a node with
    ``m`` NICs each channel crosses on its own NIC (rail-aligned), so ``c = min(m, k)`` NICs
    carry the crossing, ``D / (p c)`` each per step::

        step = max(alpha_i + D/p beta_i,  alpha_e + D/(p c) beta_e)

    One NIC per node (``c = 1``): the crossing runs at one NIC's bandwidth. One NIC per GPU
    (DGX A100/H100, ``c = k``): ``k`` times faster, as the planner's ``GroupLink.ring_bandwidth``
    counts it. ``nodes = 1`` is the ring all-reduce on the intra link.
    """
    _check_two_level(nbytes, nodes, ranks_per_node, nics_per_node)
    p = nodes * ranks_per_node
    (ai, bi), (ae, be) = intra, inter
    step = ai + nbytes / p * bi
    if nodes > 1:
        channels = min(nics_per_node, ranks_per_node)  # NICs the crossing is spread over
        step = max(step, ae + nbytes / p * be / channels)
    return 2 * (p - 1) * step


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
