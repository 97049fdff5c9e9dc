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

:func:`agree` is the argument check the other collectives run first: a recursive-doubling
all-gather of a few integers per rank (sizes, op, dtype), so a size mismatch across ranks
gives the same clear error on every rank instead of a hang or a garbled result.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from labkit.collectives.common import (
    DEFAULT_POOL,
    SUPPORTED_DTYPES,
    SUPPORTED_OPS,
    BufferPool,
    accum_dtype,
    combine_,
    global_rank,
    group_rank_and_size,
    irecv,
    isend,
    local_problem,
)

__all__ = ["recursive_doubling_all_reduce", "broadcast", "agree", "op_dtype_fields"]


def _exchange(send: torch.Tensor, recv: torch.Tensor, peer: int) -> None:
    """Send ``send`` to and receive ``recv`` from the same global rank, both in flight at once."""
    works = [irecv(recv, peer), isend(send, peer)]
    for w in works:
        w.wait()


def _recursive_doubling_(work: torch.Tensor, op: object, group: ProcessGroup | None, pool: BufferPool) -> None:
    """Reduce the flat, contiguous ``work`` across ``group`` in place (no AVG division here)."""
    rank, p = group_rank_and_size(group)
    if p == 1 or work.numel() == 0:
        return
    p2 = 1 << (p.bit_length() - 1)  # largest power of two <= p
    if rank >= p2:  # an extra rank: fold into rank - p2, then wait for the answer
        partner = global_rank(group, rank - p2)
        dist.send(work, partner)
        dist.recv(work, partner)
        return
    recv = pool.get("rd.recv", work.numel(), work.dtype, work.device)
    if rank < p - p2:
        dist.recv(recv, global_rank(group, rank + p2))
        combine_(work, recv, op)
    mask = 1
    while mask < p2:
        _exchange(work, recv, global_rank(group, rank ^ mask))
        combine_(work, recv, op)
        mask <<= 1
    if rank < p - p2:
        dist.send(work, global_rank(group, rank + p2))


def agree(
    what: str,
    fields: dict[str, int],
    problem: str | None,
    group: ProcessGroup | None,
    device: torch.device,
    pool: BufferPool = DEFAULT_POOL,
    check: bool = True,
) -> None:
    """Raise the same ValueError on every rank unless all ranks have no ``problem`` and equal ``fields``.

    With ``check=False`` nothing is exchanged: only this rank's own ``problem`` is raised.

    Each rank fills its own row of a ``p x (1 + len(fields))`` int64 table (zeros elsewhere);
    a recursive-doubling SUM gives every rank the whole table in ``log2 p`` steps. Cost: about
    ``log2(p) * alpha``, negligible next to a large collective, and the price of never hanging.
    Every rank must call ``agree``, which holds because every rank calls the collective.
    """
    if not check:
        if problem is not None:
            raise ValueError(problem)
        return
    rank, p = group_rank_and_size(group)
    names = list(fields)
    table = torch.zeros(p, 1 + len(names), dtype=torch.int64, device=device)
    table[rank, 0] = 1 if problem is not None else 0
    table[rank, 1:] = torch.tensor([fields[k] for k in names], dtype=torch.int64)
    _recursive_doubling_(table.view(-1), ReduceOp.SUM, group, pool)
    rows = table.cpu().tolist()
    if problem is not None:
        raise ValueError(problem)
    failed = [r for r in range(p) if rows[r][0]]
    if failed:
        raise ValueError(f"{what}: rank {failed[0]} rejected its arguments (see the error on that rank)")
    for j, name in enumerate(names, start=1):
        values = [row[j] for row in rows]
        if len(set(values)) > 1:
            per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ValueError(
                f"{what}: ranks disagree on {name} ({per_rank}); every rank of the group "
                "must call the collective with the same arguments"
            )


def op_dtype_fields(op: object, dtype: torch.dtype) -> dict[str, int]:
    """The op and dtype as integers for :func:`agree` (-1: unsupported or not applicable)."""
    op_code = SUPPORTED_OPS.index(op) if op in SUPPORTED_OPS else -1  # type: ignore[arg-type]
    dtype_code = SUPPORTED_DTYPES.index(dtype) if dtype in SUPPORTED_DTYPES else -1
    return {"reduce op (index in SUM, AVG, MAX, MIN)": op_code, "dtype (index in float32, float64, bfloat16, float16)": dtype_code}


def recursive_doubling_all_reduce(
    tensor: torch.Tensor,
    op: object = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    *,
    check: bool = True,
    pool: BufferPool = DEFAULT_POOL,
) -> torch.Tensor:
    """All-reduce ``tensor`` in place in ``log2 p`` steps (latency-optimal, bandwidth-poor).

    Same contract as :func:`labkit.collectives.ring.ring_all_reduce`: contiguous float tensor
    of any shape (0-d and empty included), SUM/AVG/MAX/MIN, 16-bit floats reduced in float32
    and rounded once. ``check=True`` first runs :func:`agree` on numel, op and dtype.
    """
    what = "recursive_doubling_all_reduce"
    problem = local_problem(what, {"tensor": tensor}, op)
    agree(what, {"numel": tensor.numel(), **op_dtype_fields(op, tensor.dtype)}, problem, group, tensor.device, pool, check=check)
    _, p = group_rank_and_size(group)
    flat = tensor.view(-1)
    acc = accum_dtype(tensor.dtype)
    work = flat if acc == tensor.dtype else pool.get("rd.work", flat.numel(), acc, flat.device).copy_(flat)
    _recursive_doubling_(work, op, group, pool)
    if op == ReduceOp.AVG:
        work.div_(p)
    if work is not flat:
        flat.copy_(work)
    return tensor


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
    what = "broadcast"
    rank, p = group_rank_and_size(group)
    problem = local_problem(what, {"tensor": tensor})
    if problem is None and not 0 <= src < p:
        problem = f"{what}: src must be a rank of the group (0..{p - 1}), got {src}"
    fields = {"numel": tensor.numel(), "src": src, **op_dtype_fields(None, tensor.dtype)}
    agree(what, fields, problem, group, tensor.device, pool, check=check)
    if tensor.numel() == 0:
        return tensor
    flat = tensor.view(-1)
    me = (rank - src) % p  # distance from the root
    mask = 1
    while mask < p:
        if me < mask and me + mask < p:
            dist.send(flat, global_rank(group, (me + mask + src) % p))
        elif mask <= me < 2 * mask:
            dist.recv(flat, global_rank(group, (me - mask + src) % p))
        mask <<= 1
    return tensor
