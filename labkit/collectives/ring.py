"""The ring (Patarasuk & Yuan, 2009): reduce-scatter, all-gather, and all-reduce = both.

Put the ``p`` ranks of ``group`` on a ring (rank r sends to r+1, receives from r-1) and cut
the flat tensor into ``p`` chunks like ``torch.tensor_split`` (chunk c may be empty).

* **Reduce-scatter**, ``p - 1`` steps: at step s rank r sends its partial of chunk
  ``r-s-1``, receives the partial of chunk ``r-s-2`` and adds its own data to it. Invariant:
  after step s the partial arriving at rank r holds ranks ``r-1, ..., r-s-2``; after the
  last step rank r holds chunk r reduced over all ``p`` ranks.
* **All-gather**, ``p - 1`` steps: at step s rank r forwards chunk ``r-s`` and receives chunk
  ``r-s-1`` straight into its place in the output.

Arithmetic: each rank sends ``p - 1`` chunks of ``D/p`` bytes per phase, ``2(p-1)/p * D`` for
the all-reduce, which no algorithm can beat; the price is ``2(p-1)`` latencies (``tree.py``).
Each step's send and receive go out as one batch (``common.post``), safe under NCCL.
16-bit floats are added in float32 and rounded once (``wire="accum"``), or travel in 16 bits and
are rounded at every hop (``wire="input"``: half the reduce bytes, ``p - 1`` roundings; the
bounds are in ``ring_tuned.py``). Ops: SUM, AVG, MAX, MIN. This file is
the algorithm, to be read; ``ring_tuned.py`` is the same schedule made fast.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup, ReduceOp

from labkit.collectives.common import (
    DEFAULT_POOL,
    BufferPool,
    combine_,
    exchange,
    profiled,
    validate_in_place,
    validate_sharded,
    wire_dtype,
    wire_fields,
)
from labkit.parallel.layout import global_rank, group_rank_and_size

__all__ = ["ring_reduce_scatter", "ring_all_gather", "ring_all_reduce", "Trace"]

# trace(phase, step, chunk, data): called after each receive (the notebook draws the ring from it)
Trace = Callable[[str, int, int, torch.Tensor], None]


def _neighbours(group: ProcessGroup | None) -> tuple[int, int, int, int]:
    rank, p = group_rank_and_size(group)
    return rank, p, global_rank(group, (rank + 1) % p), global_rank(group, (rank - 1) % p)


def validate_reduce_scatter(
    output_shard: torch.Tensor,
    input_full: torch.Tensor,
    op: object,
    group: ProcessGroup | None,
    check: bool,
    wire: str,
    pool: BufferPool = DEFAULT_POOL,
) -> None:
    """The checks of a ring reduce-scatter (``common.validate``), ``wire`` included."""
    tensors = {"output_shard": output_shard, "input_full": input_full}
    problem, fields = wire_fields("ring_reduce_scatter", wire)
    validate_sharded(
        "ring_reduce_scatter",
        group,
        tensors,
        "input_full",
        "output_shard",
        op=op,
        problem=problem,
        check=check,
        pool=pool,
        fields=fields,
    )


@profiled("reduce_scatter")
def ring_reduce_scatter(
    output_shard: torch.Tensor,
    input_full: torch.Tensor,
    op: object = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    *,
    check: bool = True,
    trace: Trace | None = None,
    wire: str = "accum",
) -> torch.Tensor:
    """``output_shard`` <- chunk ``rank`` of ``input_full`` reduced over ``group``; partials
    travel in float32 (``wire="accum"``) or in the input dtype (``"input"``)."""
    rank, p, right, left = _neighbours(group)
    validate_reduce_scatter(output_shard, input_full, op, group, check, wire)
    chunks = input_full.reshape(-1).tensor_split(p)  # p views, chunk c = what rank c will own
    partial = chunks[(rank - 1) % p].to(wire_dtype(input_full.dtype, wire), copy=True)
    for step in range(p - 1):
        c = (rank - step - 2) % p  # the chunk whose partial arrives at this step
        incoming = torch.empty(chunks[c].numel(), dtype=partial.dtype, device=partial.device)
        exchange(partial, right, incoming, left, group)
        partial = combine_(incoming, chunks[c], op)  # one more rank's data in it
        if trace is not None:
            trace("reduce-scatter", step, c, partial)
    if op == ReduceOp.AVG:
        partial.div_(p)
    output_shard.view(-1).copy_(partial)  # "accum": the one rounding to a 16-bit dtype
    return output_shard


@profiled("all_gather")
def ring_all_gather(
    output_full: torch.Tensor,
    input_shard: torch.Tensor,
    group: ProcessGroup | None = None,
    *,
    check: bool = True,
    trace: Trace | None = None,
) -> torch.Tensor:
    """``output_full`` <- every rank's ``input_shard``, end to end (the inverse of the above)."""
    rank, p, right, left = _neighbours(group)
    tensors = {"output_full": output_full, "input_shard": input_shard}
    validate_sharded("ring_all_gather", group, tensors, "output_full", "input_shard", check=check)
    chunks = output_full.view(-1).tensor_split(p)  # views: receiving into them fills the output
    if chunks[rank].data_ptr() != input_shard.data_ptr():  # not already in place
        chunks[rank].copy_(input_shard.view(-1))
    for step in range(p - 1):
        c = (rank - step - 1) % p
        exchange(chunks[(rank - step) % p], right, chunks[c], left, group)
        if trace is not None:
            trace("all-gather", step, c, chunks[c])
    return output_full


@profiled("all_reduce")
def ring_all_reduce(
    tensor: torch.Tensor,
    op: object = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    *,
    check: bool = True,
    trace: Trace | None = None,
    wire: str = "accum",
) -> torch.Tensor:
    """``tensor`` <- reduced over ``group``, in place: reduce-scatter into my chunk, all-gather."""
    rank, p, _, _ = _neighbours(group)
    problem, fields = wire_fields("ring_all_reduce", wire)
    validate_in_place(
        "ring_all_reduce",
        group,
        tensor,
        op=op,
        problem=problem,
        check=check,
        pool=DEFAULT_POOL,
        **fields,
    )
    mine = tensor.view(-1).tensor_split(p)[rank]  # my chunk is read at the last step only
    ring_reduce_scatter(mine, tensor, op, group, check=False, trace=trace, wire=wire)
    return ring_all_gather(tensor, mine, group, check=False, trace=trace)
