"""The ring, step by step, from a real run of the readable ring (``collectives/ring.py``).

The notebook's ring picture (``labkit.viz.collectives.plot_ring_snapshots``) is drawn from
this: each rank runs :func:`labkit.collectives.ring.ring_all_reduce` with ``trace=``, on a
tensor in which rank r holds ``2**r`` everywhere, so a partial sum's value is the bitmask of
the ranks whose data it holds. The trace records, per receive, what arrived; the snapshots
replay it step by step. Split from ``collectives.py``, which re-exports both functions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.collectives.ring import ring_all_reduce

__all__ = ["traced_ring", "ring_snapshots"]


def traced_ring() -> list[tuple[str, int, int, int]]:
    """On every rank: a readable ring all-reduce where rank r adds ``2**r``; what arrived when."""
    rank, p = dist.get_rank(), dist.get_world_size()
    seen: list[tuple[str, int, int, int]] = []
    x = torch.full((p,), float(2**rank))  # a partial sum spells who is in it
    ring_all_reduce(
        x, trace=lambda phase, step, c, data: seen.append((phase, step, c, int(data[0].item())))
    )
    return seen


def ring_snapshots(world_size: int = 4) -> list[tuple[str, list[list[int]]]]:
    """Run a ring all-reduce on ``world_size`` ranks and return who-holds-what after each step.

    Returns ``[(title, masks), ...]``: the initial state, then one entry per step of the
    reduce-scatter and of the all-gather. ``masks[rank][chunk]`` is a bitmask of the ranks whose
    data that rank's copy of that chunk contains, read from the values that actually arrived.
    """
    from labkit.launch import launch

    traces = launch(traced_ring, world_size=world_size, quiet=True, timeout=120, backend="gloo")
    p = world_size
    masks = [[1 << r for _ in range(p)] for r in range(p)]
    states = [("start", [row[:] for row in masks])]
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(p - 1):
            for rank, trace in enumerate(traces):
                for ph, s, chunk, mask in trace:
                    if ph == phase and s == step:
                        masks[rank][chunk] = mask
            states.append((f"{phase} step {step}", [row[:] for row in masks]))
    return states
