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
Each step is one batch (``common.exchange``), safe under NCCL. Ops: SUM, AVG, MAX, MIN. This
file is the algorithm, to be read: the checks and ``wire=`` (what 16-bit partials travel as) are
in ``common.py``; their costs, and this schedule made fast, in ``ring_tuned.py``.
"""

from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup, ReduceOp

from labkit.collectives import common

__all__ = ["ring_reduce_scatter", "ring_all_gather", "ring_all_reduce", "Trace"]

Trace = Callable[[str, int, int, torch.Tensor], None]  # (phase, step, chunk, data) per receive


@common.profiled("reduce_scatter")
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
    """``output_shard`` <- chunk ``rank`` of ``input_full`` reduced over ``group``."""
    rank, p, right, left = common.ring_neighbours(group)
    common.validate_reduce_scatter(output_shard, input_full, op, group, check, wire)
    chunks = input_full.reshape(-1).tensor_split(p)  # p views, chunk c = what rank c will own
    partial = chunks[(rank - 1) % p].to(common.wire_dtype(input_full.dtype, wire), copy=True)
    for step in range(p - 1):
        c = (rank - step - 2) % p  # the chunk whose partial arrives at this step
        incoming = torch.empty(chunks[c].numel(), dtype=partial.dtype, device=partial.device)
        common.exchange(partial, right, incoming, left, group)
        partial = common.combine_(incoming, chunks[c], op)  # one more rank's data in it
        if trace is not None:
            trace("reduce-scatter", step, c, partial)
    if op == ReduceOp.AVG:
        partial.div_(p)
    output_shard.view(-1).copy_(partial)  # "accum": the one rounding to a 16-bit dtype
    return output_shard


@common.profiled("all_gather")
def ring_all_gather(
    output_full: torch.Tensor,
    input_shard: torch.Tensor,
    group: ProcessGroup | None = None,
    *,
    check: bool = True,
    trace: Trace | None = None,
) -> torch.Tensor:
    """``output_full`` <- every rank's ``input_shard``, end to end (the inverse of the above)."""
    rank, p, right, left = common.ring_neighbours(group)
    common.validate_all_gather(output_full, input_shard, group, check)
    chunks = output_full.view(-1).tensor_split(p)  # views: receiving into them fills the output
    if chunks[rank].data_ptr() != input_shard.data_ptr():  # not already in place
        chunks[rank].copy_(input_shard.view(-1))
    for step in range(p - 1):
        c = (rank - step - 1) % p
        common.exchange(chunks[(rank - step) % p], right, chunks[c], left, group)
        if trace is not None:
            trace("all-gather", step, c, chunks[c])
    return output_full


@common.profiled("all_reduce")
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
    rank, p, _, _ = common.ring_neighbours(group)
    common.validate_all_reduce(tensor, op, group, check=check, wire=wire)
    mine = tensor.view(-1).tensor_split(p)[rank]  # my chunk is read at the last step only
    ring_reduce_scatter(mine, tensor, op, group, check=False, trace=trace, wire=wire)
    return ring_all_gather(tensor, mine, group, check=False, trace=trace)
