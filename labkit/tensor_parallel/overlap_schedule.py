"""The chunk orders of the overlapped TP matmuls, as data, and the check that proves one.

On a ring of ``t`` ranks (rank r sends to r + 1, receives from r - 1), a decomposed
all-gather-matmul is fully described by which chunk each rank multiplies at each step:

* :func:`ag_order` ``[r, r-1, ..., r-t+1]`` (mod t): at step s rank r multiplies chunk
  ``r - s``, sends it on and receives chunk ``r - s - 1``, which is exactly what rank r - 1
  multiplied (and sends) at step s. Each chunk is multiplied once, after it arrived.
* :func:`rs_order` ``[r-1, r-2, ..., r]``: at step s rank r adds its partial product of chunk
  ``r - s - 1`` to the sum rank r - 1 had at step s - 1, the same chunk; the sum of chunk k
  starts at rank k + 1, visits every rank once and ends at its owner k.

:func:`schedule_problems` replays an order for every rank and says what goes wrong (empty:
correct): a chunk multiplied before it arrived, a chunk received into the wrong place (the
result silently reordered), a chunk multiplied twice or never, a sum that skips a rank or ends
at the wrong owner, or ranks that disagree on the number of steps (a receive no one sends:
a hang). The message order of each step is :class:`~labkit.tensor_parallel.overlap_ring.
RingSteps`'s business (one batch, NCCL-safe); ``labkit.collectives.nccl_order`` checks that.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Order", "ag_order", "rs_order", "schedule_problems"]

Order = Callable[[int, int], list[int]]  # (rank, t) -> the chunk at each step


def ag_order(rank: int, t: int) -> list[int]:
    """The chunk rank ``rank`` multiplies at each step of the all-gather-matmul."""
    return [(rank - s) % t for s in range(t)]


def rs_order(rank: int, t: int) -> list[int]:
    """The chunk whose partial sum rank ``rank`` adds at each step of matmul-reduce-scatter."""
    return [(rank - s - 1) % t for s in range(t)]


def _lengths(orders: list[list[int]], t: int) -> list[str]:
    bad = [r for r, o in enumerate(orders) if len(o) != t]
    return [
        f"rank {r} has {len(orders[r])} steps, not t={t}: its neighbours wait for a message "
        "that never comes (a hang)"
        for r in bad
    ]


def schedule_problems(order: Order, t: int, kind: str = "all_gather") -> list[str]:
    """Everything wrong with ``order`` on a ring of ``t`` ranks, for ``kind`` "all_gather"
    (all-gather-matmul) or "reduce_scatter" (matmul-reduce-scatter); [] when correct."""
    if kind not in ("all_gather", "reduce_scatter"):
        raise ValueError(f"kind must be 'all_gather' or 'reduce_scatter', got {kind!r}")
    orders = [list(order(r, t)) for r in range(t)]
    problems = _lengths(orders, t)
    if problems:
        return problems
    for r, o in enumerate(orders):
        if sorted(o) != list(range(t)):
            problems.append(f"rank {r} multiplies chunks {o}: each of 0..{t - 1} exactly once")
    if kind == "all_gather":
        for r in range(t):
            held, left = {r}, orders[(r - 1) % t]
            for s, k in enumerate(orders[r]):
                if k not in held:
                    problems.append(f"rank {r} multiplies chunk {k} at step {s} before it arrived")
                if s < t - 1:  # receives what the left neighbour sends: its own chunk of step s
                    if orders[r][s + 1] != left[s]:
                        problems.append(
                            f"rank {r} receives chunk {left[s]} from rank {(r - 1) % t} at step "
                            f"{s} into the place of chunk {orders[r][s + 1]}: reordered"
                        )
                    held.add(left[s])
        return problems
    for r in range(t):
        left = orders[(r - 1) % t]
        for s in range(1, t):
            if orders[r][s] != left[s - 1]:
                problems.append(
                    f"rank {r} adds its chunk {orders[r][s]} at step {s} to the sum of chunk "
                    f"{left[s - 1]} from rank {(r - 1) % t}: mixed chunks"
                )
        if orders[r][-1] != r:
            problems.append(f"rank {r} ends holding the sum of chunk {orders[r][-1]}, not {r}")
    return problems
