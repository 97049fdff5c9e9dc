"""The ring (Patarasuk & Yuan, 2009): reduce-scatter, all-gather, and all-reduce = both.

Ranks on a ring (r sends to r+1); the flat tensor cut like ``torch.tensor_split`` in p chunks.
* **Reduce-scatter**, ``p - 1`` steps: at step s rank r sends its partial of chunk
  ``r-s-1``, receives the partial of chunk ``r-s-2`` and adds its own data to it. Invariant:
  after step s the partial arriving at rank r holds ranks ``r-1, ..., r-s-2``; after the
  last step rank r holds chunk r reduced over all ``p`` ranks.
* **All-gather**, ``p - 1`` steps: at step s rank r forwards chunk ``r-s`` and receives chunk
  ``r-s-1`` straight into its place in the output.
Bytes sent per rank: ``(p-1) D/p`` a phase, ``2(p-1)/p D`` (optimal); ``2(p-1)`` latencies.
One batch a step (``common.exchange``: NCCL-safe); SUM, AVG, MAX, MIN; checks in ``common.py``,
made fast in ``ring_tuned.py``. Compute runs in ``g.run`` (``guard.py``): one that raises
leaves its rank exchanging, and every rank raises at the end, the group still usable.
"""

from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup, ReduceOp

from labkit.collectives import common
from labkit.collectives.guard import guarded

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
    with guarded("ring_reduce_scatter", group, input_full.device, check) as g:
        for step in range(p - 1):
            c = (rank - step - 2) % p  # the chunk whose partial arrives at this step
            incoming = torch.empty(chunks[c].numel(), dtype=partial.dtype, device=partial.device)
            common.exchange(partial, right, incoming, left, group)
            partial = g.run(common.combine_, incoming, chunks[c], op, default=incoming)
            if trace is not None:  # partial: one more rank's data in it
                g.run(trace, "reduce-scatter", step, c, partial)
        if op == ReduceOp.AVG:
            g.run(partial.div_, p)
        g.run(output_shard.view(-1).copy_, partial)  # "accum": the one rounding to 16 bits
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
    with guarded("ring_all_gather", group, output_full.device, check) as g:
        for step in range(p - 1):
            c = (rank - step - 1) % p
            common.exchange(chunks[(rank - step) % p], right, chunks[c], left, group)
            if trace is not None:
                g.run(trace, "all-gather", step, c, chunks[c])
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
    with guarded("ring_all_reduce", group, tensor.device, check):  # both halves: 1 settle
        ring_reduce_scatter(mine, tensor, op, group, check=False, trace=trace, wire=wire)
        return ring_all_gather(tensor, mine, group, check=False, trace=trace)
