"""Latency-optimal collectives for small messages: recursive doubling and a binomial-tree broadcast.

A ring moves the fewest bytes, but it takes ``2(p-1)`` sequential steps, and every step pays
the latency ``alpha`` (~80 us for a gloo send on this machine). For a 4 KB gradient that
latency is all there is. Recursive doubling (Thakur, Rabenseifner & Gropp, "Optimization of
Collective Communication Operations in MPICH", 2005) needs only ``log2(p)`` steps:

    step k (k = 0, 1, ...): partner = rank XOR 2**k; swap the whole vector; reduce.

After step k every rank holds the reduction of its block of ``2**(k+1)`` ranks, so after
``log2 p`` steps everyone holds the total. Each step moves the full ``D`` bytes, hence

    T_rd = log2(p) * (alpha + D * beta)      vs      T_ring = 2(p-1) * alpha + 2(p-1)/p * D * beta

and recursive doubling wins while ``D`` is small (see ``cost_model.crossover_bytes``).
When ``p`` is not a power of two, the ``p - p2`` ranks above the largest power of two ``p2``
first fold their data into a partner, sit out, and get the result back: two extra steps.

Invariant: every rank ends with bit-identical values, because at each step the two partners
combine the same two operands (``a + b == b + a`` in IEEE arithmetic, and so does max/min).

:func:`broadcast` is the binomial tree: in round k, the ``2**k`` ranks that already hold the
data each send it to one more rank, so ``ceil(log2 p)`` rounds of ``alpha + D * beta``.

Every swap is one ``dist.batch_isend_irecv`` (``common.exchange``), safe under NCCL; the
fold-in and hand-back of the extra ranks are blocking sends and receives in matching order.

:func:`halving_doubling_all_reduce` is Rabenseifner's algorithm (same paper, section 4): a
reduce-scatter by recursive *halving* (step k: partner = rank XOR p2/2**(k+1); keep one half of
the current range of blocks, send the other half, reduce what arrives), then an all-gather by
recursive doubling that retraces the steps backwards. ``2 log2 p`` steps moving ``D/2, D/4,
...`` bytes each way, so

    T_rhd = 2 log2(p) * alpha + 2(p-1)/p * D * beta

the ring's bytes with the tree's step count. The vector is cut into ``p2`` blocks of
``chunk_sizes(n, p2)`` (any ``n``, remainders on the first blocks); after the halving, rank r
alone holds the reduced block r, so every rank ends bit-identical (copies of one sum).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from labkit.collectives.common import (
    DEFAULT_POOL,
    BufferPool,
    chunk_offsets,
    combine_,
    exchange,
    global_rank,
    group_rank_and_size,
    profiled,
    validate_in_place,
    wire_dtype,
    wire_fields,
)
from labkit.collectives.guard import guarded

__all__ = ["recursive_doubling_all_reduce", "halving_doubling_all_reduce", "broadcast"]


def _combine(acc: torch.Tensor, x: torch.Tensor, op: object, group: ProcessGroup | None) -> None:
    """``combine_`` as a compute step of the caller's guard (``guard.py``): if it raises, this
    rank keeps exchanging, and every rank raises when the all-reduce ends."""
    with guarded("tree", group, acc.device) as g:
        g.run(combine_, acc, x, op)


def _recursive_doubling_(
    work: torch.Tensor, op: object, group: ProcessGroup | None, pool: BufferPool
) -> None:
    """Reduce the flat, contiguous ``work`` across ``group`` in place (no AVG division here)."""
    rank, p = group_rank_and_size(group)
    if p == 1 or work.numel() == 0:
        return
    p2 = 1 << (p.bit_length() - 1)  # largest power of two <= p
    if rank >= p2:  # an extra rank: fold into rank - p2, then wait for the answer
        partner = global_rank(group, rank - p2)
        dist.send(work, partner, group=group)
        dist.recv(work, partner, group=group)
        return
    recv = pool.get("rd.recv", work.numel(), work.dtype, work.device)
    if rank < p - p2:
        dist.recv(recv, global_rank(group, rank + p2), group=group)
        _combine(work, recv, op, group)
    mask = 1
    while mask < p2:
        partner = global_rank(group, rank ^ mask)
        exchange(work, partner, recv, partner, group)
        _combine(work, recv, op, group)
        mask <<= 1
    if rank < p - p2:
        dist.send(work, global_rank(group, rank + p2), group=group)


Steps = list[tuple[int, int, int, int, int]]  # (partner, keep_lo, keep_hi, give_lo, give_hi)


def _halve_(work: torch.Tensor, op: object, group: ProcessGroup | None, pool: BufferPool) -> Steps:
    """Recursive-halving reduce-scatter among the ``p2`` power-of-two ranks (extras folded in).

    Returns the steps ``(partner, keep_lo, keep_hi, give_lo, give_hi)`` as element offsets, for
    :func:`_double_back_`; afterwards ``work[off[r]:off[r+1]]`` is the reduced block ``r``.
    """
    rank, p = group_rank_and_size(group)
    p2 = 1 << (p.bit_length() - 1)
    off = chunk_offsets(work.numel(), p2)  # p2 + 1 block boundaries
    lo, hi, mask = 0, p2, p2 >> 1
    steps: Steps = []
    recv = pool.get("rhd.recv", off[p2 // 2] if p2 > 1 else 0, work.dtype, work.device)
    while mask:
        mid = (lo + hi) // 2  # keep the half of the blocks my bit selects, send the other
        keep, give = ((mid, hi), (lo, mid)) if rank & mask else ((lo, mid), (mid, hi))
        k0, k1, g0, g1 = off[keep[0]], off[keep[1]], off[give[0]], off[give[1]]
        partner = global_rank(group, rank ^ mask)
        exchange(work[g0:g1], partner, recv[: k1 - k0], partner, group)
        _combine(work[k0:k1], recv[: k1 - k0], op, group)
        steps.append((partner, k0, k1, g0, g1))
        lo, hi = keep
        mask >>= 1
    return steps


def _double_back_(work: torch.Tensor, steps: Steps, group: ProcessGroup | None) -> None:
    """All-gather by retracing the halving backwards: send what I hold, receive what I gave."""
    for partner, k0, k1, g0, g1 in reversed(steps):
        exchange(work[k0:k1], partner, work[g0:g1], partner, group)


def _fold_in(work: torch.Tensor, op: object, group: ProcessGroup | None, pool: BufferPool) -> bool:
    """Fold the ranks above the largest power of two into a partner; True on such an extra."""
    rank, p = group_rank_and_size(group)
    p2 = 1 << (p.bit_length() - 1)
    if rank >= p2:
        dist.send(work, global_rank(group, rank - p2), group=group)
        return True
    if rank < p - p2:
        recv = pool.get("rhd.fold", work.numel(), work.dtype, work.device)
        dist.recv(recv, global_rank(group, rank + p2), group=group)
        _combine(work, recv, op, group)
    return False


def _hand_back(work: torch.Tensor, extra: bool, group: ProcessGroup | None) -> None:
    rank, p = group_rank_and_size(group)
    p2 = 1 << (p.bit_length() - 1)
    if extra:
        dist.recv(work, global_rank(group, rank - p2), group=group)
    elif rank < p - p2:
        dist.send(work, global_rank(group, rank + p2), group=group)


@profiled("all_reduce")
def halving_doubling_all_reduce(
    tensor: torch.Tensor,
    op: object = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    *,
    check: bool = True,
    pool: BufferPool = DEFAULT_POOL,
) -> torch.Tensor:
    """All-reduce ``tensor`` in place by Rabenseifner's halving-doubling (see module docstring).

    Same contract as :func:`recursive_doubling_all_reduce` with ``wire="accum"``; 16-bit floats
    are reduced in float32 and rounded once.
    """
    validate_in_place("halving_doubling_all_reduce", group, tensor, op=op, check=check, pool=pool)
    _, p = group_rank_and_size(group)
    flat = tensor.view(-1)
    acc = wire_dtype(tensor.dtype, "accum")
    work = flat
    if acc != tensor.dtype:
        work = pool.get("rhd.work", flat.numel(), acc, flat.device).copy_(flat)
    with guarded("halving_doubling_all_reduce", group, flat.device, check) as g:
        if p > 1 and work.numel():
            extra = _fold_in(work, op, group, pool)
            if not extra:
                _double_back_(work, _halve_(work, op, group, pool), group)
            _hand_back(work, extra, group)
        g.run(_finish, flat, work, p if op == ReduceOp.AVG else 1)
    return tensor


@profiled("all_reduce")
def recursive_doubling_all_reduce(
    tensor: torch.Tensor,
    op: object = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    *,
    check: bool = True,
    pool: BufferPool = DEFAULT_POOL,
    wire: str = "accum",
) -> torch.Tensor:
    """All-reduce ``tensor`` in place in ``log2 p`` steps (latency-optimal, bandwidth-poor).

    Same contract as :func:`labkit.collectives.ring.ring_all_reduce`: contiguous float tensor
    of any shape (0-d and empty included), SUM/AVG/MAX/MIN. 16-bit floats are reduced in
    float32 and rounded once (``wire="accum"``), or swapped in 16 bits and rounded after every
    step (``wire="input"``: half the bytes; ``ceil(log2 p)`` roundings on the way, at most
    ``p - 1``, so within the bound stated in ``ring_tuned.py``; partners still add the same two
    operands, so every rank stays bit-identical). ``check=True``: validate first.
    """
    problem, fields = wire_fields("recursive_doubling_all_reduce", wire)
    validate_in_place(
        "recursive_doubling_all_reduce",
        group,
        tensor,
        op=op,
        problem=problem,
        check=check,
        pool=pool,
        **fields,
    )
    _, p = group_rank_and_size(group)
    flat = tensor.view(-1)
    acc = wire_dtype(tensor.dtype, wire)
    work = flat
    if acc != tensor.dtype:  # 16-bit floats, "accum": reduce in float32, round once at the end
        work = pool.get("rd.work", flat.numel(), acc, flat.device).copy_(flat)
    with guarded("recursive_doubling_all_reduce", group, flat.device, check) as g:
        _recursive_doubling_(work, op, group, pool)
        g.run(_finish, flat, work, p if op == ReduceOp.AVG else 1)
    return tensor


def _finish(flat: torch.Tensor, work: torch.Tensor, divide: int) -> None:
    """AVG's one division, and the one rounding of a float32 ``work`` to ``flat``'s dtype."""
    if divide > 1:
        work.div_(divide)
    if work is not flat:
        flat.copy_(work)


@profiled("broadcast")
def broadcast(
    tensor: torch.Tensor,
    src: int = 0,
    group: ProcessGroup | None = None,
    *,
    check: bool = True,
    pool: BufferPool = DEFAULT_POOL,
) -> torch.Tensor:
    """Copy ``tensor`` of group rank ``src`` into ``tensor`` on every rank, by a binomial tree.

    ``src`` is a rank *inside* ``group``. Rounds: ``ceil(log2 p)``; in round k, the ranks at
    distance ``< 2**k`` from ``src`` (counting around the group) send to distance ``+ 2**k``.
    """
    rank, p = group_rank_and_size(group)
    problem = (
        None
        if 0 <= src < p
        else f"broadcast: src must be a rank of the group (0..{p - 1}), got {src}"
    )
    validate_in_place("broadcast", group, tensor, src=src, problem=problem, check=check, pool=pool)
    if tensor.numel() == 0:
        return tensor
    flat = tensor.view(-1)
    me = (rank - src) % p  # distance from the root
    mask = 1
    while mask < p:
        if me < mask and me + mask < p:
            dist.send(flat, global_rank(group, (me + mask + src) % p), group=group)
        elif mask <= me < 2 * mask:
            dist.recv(flat, global_rank(group, (me - mask + src) % p), group=group)
        mask <<= 1
    return tensor
