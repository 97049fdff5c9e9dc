"""One message between two ranks, timed: the ping-pong that fits a link's alpha and beta.

Split from ``collectives.py`` (which re-exports both functions): that module measures whole
collectives; this one a single message, the alpha-beta model's unit. A round trip is two
messages, so one-way time = round trip / 2; the first ``warmup`` rounds pay for connection
set-up and are dropped.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["pair_one_way", "ping_pong"]


def pair_one_way(
    pair: tuple[int, int], sizes: Sequence[int], repeats: int, warmup: int
) -> dict[int, list[float]]:
    """Call on every rank: ranks ``pair[0]`` and ``pair[1]`` ping-pong a message of each size
    (bytes) and return its one-way seconds (round trip / 2) per repeat, warm-up rounds dropped;
    other ranks return ``{}``. Each phase is one ``batch_isend_irecv`` per side, the send
    matched by the receive: NCCL-safe."""
    rank = dist.get_rank()
    if rank not in pair:
        return {}
    peer = pair[1] if rank == pair[0] else pair[0]
    one_way: dict[int, list[float]] = {}
    for nbytes in sizes:
        buf = torch.zeros(nbytes // 4)
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            for sending in (rank == pair[0], rank != pair[0]):  # the ping, then the reply
                op = dist.isend if sending else dist.irecv
                for work in dist.batch_isend_irecv([dist.P2POp(op, buf, peer)]):
                    work.wait()
            if i >= warmup:  # a round trip is two messages
                one_way.setdefault(nbytes, []).append((time.perf_counter() - t0) / 2)
    return one_way


def ping_pong(
    sizes: Sequence[int], repeats: int = 15, warmup: int = 3, timeout: float = 120
) -> dict[int, list[float]]:
    """One-way time of a message of each size (bytes) between 2 gloo ranks: every repeat's
    seconds, warm-up rounds dropped (the first messages pay for connection set-up)."""
    from labkit.launch import launch

    return launch(
        pair_one_way,
        (0, 1),
        list(sizes),
        repeats,
        warmup,
        world_size=2,
        timeout=timeout,
        quiet=True,
        backend="gloo",
    )[0]
