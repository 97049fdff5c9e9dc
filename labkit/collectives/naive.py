"""The naive all-reduce: every rank sends its tensor to a root, the root reduces and sends it back.

This is the slow baseline the ring (``ring.py``) is measured against. With ``p`` ranks and a
tensor of ``D`` bytes, the root's link carries everything:

    reduce:    the root receives (p - 1) * D bytes, one message after another
    broadcast: the root sends    (p - 1) * D bytes, one message after another

    T_naive = 2(p-1) * alpha + 2(p-1) * D * beta

The bandwidth term grows linearly with ``p`` while the ring's stays at ``2(p-1)/p * D * beta``
(< ``2 D beta``): at 8 ranks the naive version is already ~8x slower on large tensors, and the
other ranks' links sit idle while the root works. Posting all receives at once does not help:
they still share the root's one link (that is what ``beta`` models).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from labkit.collectives.common import (
    DEFAULT_POOL,
    BufferPool,
    accum_dtype,
    combine_,
    global_rank,
    group_rank_and_size,
    profiled,
    validate_in_place,
)
from labkit.collectives.guard import guarded

__all__ = ["naive_all_reduce"]


@profiled("all_reduce")
def naive_all_reduce(
    tensor: torch.Tensor,
    op: object = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    *,
    root: int = 0,
    check: bool = True,
    pool: BufferPool = DEFAULT_POOL,
) -> torch.Tensor:
    """All-reduce ``tensor`` in place by reduce-to-``root`` then broadcast-from-``root``.

    Same contract as :func:`labkit.collectives.ring.ring_all_reduce` (any shape, SUM/AVG/MAX/MIN,
    16-bit floats reduced in float32). ``root`` is a rank inside ``group``.
    """
    rank, p = group_rank_and_size(group)
    bad_root = f"naive_all_reduce: root must be a rank of the group (0..{p - 1}), got {root}"
    problem = None if 0 <= root < p else bad_root
    validate_in_place(
        "naive_all_reduce", group, tensor, root=root, op=op, problem=problem, check=check, pool=pool
    )
    if p == 1 or tensor.numel() == 0:
        return tensor
    flat = tensor.view(-1)
    if rank != root:  # a guard here too: every rank of the group settles with the root
        with guarded("naive_all_reduce", group, flat.device, check):
            dist.send(flat, global_rank(group, root), group=group)  # 1) my contribution goes up
            dist.recv(flat, global_rank(group, root), group=group)  # 2) the result comes back
        return tensor
    acc = accum_dtype(flat.dtype)
    with guarded("naive_all_reduce", group, flat.device, check) as g:  # compute: g.run
        total = flat if acc == flat.dtype else pool.get("naive.acc", flat.numel(), acc, flat.device)
        if total is not flat:
            g.run(total.copy_, flat)
        incoming = pool.get("naive.recv", flat.numel(), flat.dtype, flat.device)
        for other in range(p):  # 1) reduce: (p-1) full tensors through the root's link
            if other != root:
                dist.recv(incoming, global_rank(group, other), group=group)
                g.run(combine_, total, incoming, op)
        if op == ReduceOp.AVG:
            g.run(total.div_, p)
        if total is not flat:
            g.run(flat.copy_, total)
        # 2) broadcast: (p-1) full tensors again. Ungrouped, but NCCL-safe: towards each peer
        # the root posts recv then send, the peer send then recv, so the per-pair orders match.
        peers = [global_rank(group, o) for o in range(p) if o != root]
        works = [dist.isend(flat, peer, group=group) for peer in peers]
        for w in works:
            w.wait()  # type: ignore[union-attr]
    return tensor
