"""Ring reduce-scatter, ring all-gather, and ring all-reduce = reduce-scatter + all-gather.

Put the ``p`` ranks on a ring (rank r sends to r+1 and receives from r-1) and cut the flat
tensor of ``D`` bytes into ``p`` chunks (:func:`~labkit.collectives.common.chunk_sizes`).

**Reduce-scatter**, ``p - 1`` steps. At step ``s`` rank ``r`` sends its running partial of
chunk ``(r - s - 1) % p`` to the right and receives the left neighbour's partial of chunk
``(r - s - 2) % p``, which it combines with its own input. Each partial gains one rank per
step, so after ``p - 1`` steps rank r holds chunk r reduced over all ranks::

    p = 3, step 0:  r0 sends c2, r1 sends c0, r2 sends c1     (each chunk: 2 contributors)
           step 1:  r0 sends c1+, r1 sends c2+, r2 sends c0+  (each chunk: all 3) -> r holds c_r

**All-gather**, ``p - 1`` steps. At step ``s`` rank r forwards chunk ``(r - s) % p`` to the
right and receives chunk ``(r - s - 1) % p`` straight into its place in the output.

**Why the ring is bandwidth-optimal.** Every rank sends ``(p-1)`` chunks of ``D/p`` bytes per
phase, ``2(p-1)/p * D`` in all, which tends to ``2D`` and does not grow with ``p``. Any
all-reduce must send at least that much (each rank's data has to leave it, and the result
has to arrive), whereas reduce-to-root + broadcast (``naive.py``) pushes ``2(p-1) D`` bytes
through the root's single link. The price is ``2(p-1)`` latencies (see ``tree.py``).

Implementation choices (the reason this file is fast, not only correct):

* Data moves with ``dist.irecv``/``dist.isend`` posted together, so the send to the right and
  the receive from the left overlap; gloo reads and writes the tensors' memory directly.
* Nothing is allocated per call: partial results live in two chunk-sized buffers from a
  :class:`~labkit.collectives.common.BufferPool`, used alternately (receive into one while
  the other is being sent). All-gather receives straight into the output: zero copies.
* Every chunk travels as a few pieces (at most 4, at least 1 MB each), a pipeline: a piece is reduced while
  the next one arrives; in the all-gather a piece is forwarded the moment it lands; and in
  the all-reduce each finished piece of the reduce-scatter leaves for the all-gather at once,
  so the two phases overlap instead of running back to back.
* float16/bfloat16: partials travel and are added in float32, so the result is the float32
  sum rounded once to the input dtype (error within 1 ulp of the exact sum, while a native
  16-bit ring rounds at every hop). The reduce-scatter phase then moves twice the bytes.

Validation: with ``check=True`` (default) every rank first agrees on numel, op and dtype
(:func:`~labkit.collectives.tree.agree`, ~``log2(p)`` latencies), so a mismatch is one clear
``ValueError`` on every rank, never a hang. ``check=False`` skips that exchange.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from labkit.collectives.common import (
    DEFAULT_POOL,
    BufferPool,
    accum_dtype,
    chunk_offsets,
    chunk_sizes,
    combine_,
    global_rank,
    group_rank_and_size,
    irecv,
    isend,
    local_problem,
)
from labkit.collectives.tree import agree, op_dtype_fields

__all__ = ["ring_reduce_scatter", "ring_all_gather", "ring_all_reduce", "Trace"]

# trace(phase, step, chunk, data): called on the receiving rank after each receive, with the
# chunk index and what arrived (the notebook draws the ring from it).
Trace = Callable[[str, int, int, torch.Tensor], None]
BLOCK_BYTES = 1 << 20  # smallest message: large enough to amortise alpha
MAX_PIECES = 4  # most messages per chunk per step: enough to overlap, few wake-ups
_TAG_RS, _TAG_AG = 1, 2  # separate tags: all-gather pieces may overtake the reduce-scatter's


def _pieces(n: int, itemsize: int, block: int) -> list[tuple[int, int]]:
    """Cut a chunk of ``n`` elements into at most MAX_PIECES messages of at least ``block`` bytes.

    Why both bounds: pieces pipeline the reduction with the transfer, but every piece costs a
    wake-up of this thread, which on a busy 2-core machine can cost more than it saves.

    Both ends of a link must cut a chunk identically (gloo lets a short message land in a
    longer buffer without complaint), so the cut never depends on the accumulation dtype.
    """
    step = max(1, block // itemsize, -(-n // MAX_PIECES))
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def _reduce_scatter_core(
    out: torch.Tensor,
    inp: torch.Tensor,
    op: object,
    group: ProcessGroup | None,
    pool: BufferPool,
    trace: Trace | None,
    block: int,
    gather: _RingAllGather | None = None,
) -> None:
    """Ring reduce-scatter of flat ``inp`` into flat ``out`` (chunk ``rank``); AVG divides here.

    ``out`` may alias ``inp``'s own chunk: that chunk is only read in the last step. With
    ``gather`` (all-reduce), each finished piece of ``out`` is handed to the all-gather at once,
    so the all-gather's first step overlaps the reduce-scatter's last one.
    """
    rank, p = group_rank_and_size(group)
    n = inp.numel()
    size, off = chunk_sizes(n, p), chunk_offsets(n, p)
    right, left = global_rank(group, (rank + 1) % p), global_rank(group, (rank - 1) % p)
    acc = accum_dtype(inp.dtype)
    bufs = [pool.get(f"ring.rs{i}", size[0], acc, inp.device) for i in (0, 1)]

    def mine(c: int) -> torch.Tensor:
        return inp[off[c] : off[c] + size[c]]

    send = mine((rank - 1) % p)
    if acc != inp.dtype:  # partials travel in float32: stage our first chunk there too
        send = bufs[1][: send.numel()].copy_(send)
    for s in range(p - 1):
        c = (rank - s - 2) % p  # the chunk whose partial arrives this step
        recv = bufs[s % 2][: size[c]]
        last = s == p - 2
        # post every piece's receive and send at once; reduce pieces as they land
        pieces = _pieces(size[c], inp.element_size(), block)
        recvs = [irecv(recv[a:b], left, _TAG_RS) for a, b in pieces]
        sends = [isend(send[a:b], right, _TAG_RS) for a, b in _pieces(send.numel(), inp.element_size(), block)]
        if last and gather is not None:
            gather.post_recvs()
        direct = last and acc == inp.dtype and op in (ReduceOp.SUM, ReduceOp.AVG)
        for work, (a, b) in zip(recvs, pieces):
            work.wait()
            if direct:  # the last partial plus ours goes straight into the output
                torch.add(recv[a:b], mine(c)[a:b], out=out[a:b])
            else:
                combine_(recv[a:b], mine(c)[a:b], op)
            if last:
                result = out[a:b] if direct else recv[a:b]
                if op == ReduceOp.AVG:
                    result.div_(p)
                if not direct:
                    out[a:b].copy_(result)  # the float32 result, rounded once to the output dtype
                if gather is not None:
                    gather.send_own(a, b)
        for work in sends:
            work.wait()
        if trace is not None:
            trace("reduce-scatter", s, c, out if last else recv)
        send = recv


class _RingAllGather:
    """Ring all-gather in place on flat ``out``, pipelined piece by piece.

    Every receive lands in a different chunk of ``out``, so all ``(p-1)`` steps' receives are
    posted up front; a piece that arrives at step ``s`` is forwarded to the right at once as a
    piece of step ``s + 1``. Sender and receiver cut each chunk into the same pieces, and gloo
    matches messages of one tag in order, so every piece lands where it belongs.
    """

    def __init__(self, out: torch.Tensor, group: ProcessGroup | None, block: int):
        self.rank, self.p = group_rank_and_size(group)
        self.out, self.block = out, block
        self.size, self.off = chunk_sizes(out.numel(), self.p), chunk_offsets(out.numel(), self.p)
        self.right = global_rank(group, (self.rank + 1) % self.p)
        self.left = global_rank(group, (self.rank - 1) % self.p)
        self.recvs: list[tuple[int, int, int, int, dist.Work]] = []
        self.sends: list[dist.Work] = []

    def chunk(self, c: int) -> torch.Tensor:
        return self.out[self.off[c] : self.off[c] + self.size[c]]

    def pieces(self, c: int) -> list[tuple[int, int]]:
        return _pieces(self.size[c], self.out.element_size(), self.block)

    def post_recvs(self) -> None:
        for s in range(self.p - 1):
            c = (self.rank - s - 1) % self.p
            for a, b in self.pieces(c):
                self.recvs.append((s, c, a, b, irecv(self.chunk(c)[a:b], self.left, _TAG_AG)))

    def send_own(self, a: int, b: int) -> None:
        """Step 0: send a finished piece of this rank's own chunk."""
        self.sends.append(isend(self.chunk(self.rank)[a:b], self.right, _TAG_AG))

    def run(self, trace: Trace | None, own_sent: bool = False) -> None:
        if not self.recvs:
            self.post_recvs()
        if not own_sent:
            for a, b in self.pieces(self.rank):
                self.send_own(a, b)
        for s, c, a, b, work in self.recvs:
            work.wait()
            if s < self.p - 2:  # forward at once: it is what the right neighbour needs next
                self.sends.append(isend(self.chunk(c)[a:b], self.right, _TAG_AG))
            if trace is not None and b == self.size[c]:
                trace("all-gather", s, c, self.chunk(c))
        for work in self.sends:
            work.wait()


def ring_reduce_scatter(
    output_shard: torch.Tensor,
    input_full: torch.Tensor,
    op: object = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    *,
    check: bool = True,
    pool: BufferPool = DEFAULT_POOL,
    trace: Trace | None = None,
    block: int = BLOCK_BYTES,
) -> torch.Tensor:
    """Reduce ``input_full`` across ``group`` and keep this rank's chunk in ``output_shard``.

    ``input_full``: contiguous, ``n`` elements (any shape, read as flat), unchanged.
    ``output_shard``: contiguous, ``chunk_sizes(n, p)[rank]`` elements: ``n // p``, plus one
    on the first ``n % p`` ranks (``torch.tensor_split`` layout). When ``p`` divides ``n`` this
    is exactly ``dist.reduce_scatter_tensor(output_shard, input_full, op, group)``.
    ``op``: SUM, AVG, MAX or MIN. Every rank sends ``(p-1)/p * n`` elements. Returns ``output_shard``.
    """
    what = "ring_reduce_scatter"
    rank, p = group_rank_and_size(group)
    n = input_full.numel()
    tensors = {"output_shard": output_shard, "input_full": input_full}
    problem = local_problem(what, tensors, op, {"output_shard": chunk_sizes(n, p)[rank]})
    agree(what, {"numel of input_full": n, **op_dtype_fields(op, input_full.dtype)}, problem, group, input_full.device, pool, check=check)
    if p == 1:
        output_shard.view(-1).copy_(input_full.view(-1))
    elif n > 0:
        _reduce_scatter_core(output_shard.view(-1), input_full.view(-1), op, group, pool, trace, block)
    return output_shard


def ring_all_gather(
    output_full: torch.Tensor,
    input_shard: torch.Tensor,
    group: ProcessGroup | None = None,
    *,
    check: bool = True,
    pool: BufferPool = DEFAULT_POOL,
    trace: Trace | None = None,
    block: int = BLOCK_BYTES,
) -> torch.Tensor:
    """Gather every rank's ``input_shard`` into ``output_full`` (the inverse of the scatter above).

    ``output_full``: contiguous, ``n`` elements (any shape, filled as flat).
    ``input_shard``: contiguous, ``chunk_sizes(n, p)[rank]`` elements; it may already be a view
    of ``output_full``'s chunk ``rank`` (then nothing is copied). When ``p`` divides ``n``
    this is exactly ``dist.all_gather_into_tensor(output_full, input_shard, group)``.
    Every rank sends ``(p-1)/p * n`` elements. Returns ``output_full``.
    """
    what = "ring_all_gather"
    rank, p = group_rank_and_size(group)
    n = output_full.numel()
    tensors = {"output_full": output_full, "input_shard": input_shard}
    problem = local_problem(what, tensors, None, {"input_shard": chunk_sizes(n, p)[rank]})
    agree(what, {"numel of output_full": n, **op_dtype_fields(None, output_full.dtype)}, problem, group, output_full.device, pool, check=check)
    flat = output_full.view(-1)
    start = chunk_offsets(n, p)[rank]
    mine = flat[start : start + input_shard.numel()]
    if input_shard.numel() and mine.data_ptr() != input_shard.data_ptr():
        mine.copy_(input_shard.view(-1))
    if n > 0 and p > 1:
        _RingAllGather(flat, group, block).run(trace)
    return output_full


def ring_all_reduce(
    tensor: torch.Tensor,
    op: object = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    *,
    check: bool = True,
    pool: BufferPool = DEFAULT_POOL,
    trace: Trace | None = None,
    block: int = BLOCK_BYTES,
) -> torch.Tensor:
    """All-reduce ``tensor`` in place: ring reduce-scatter, then ring all-gather of the result.

    Any shape (0-d and empty included), contiguous, float32/float64/bfloat16/float16;
    SUM/AVG/MAX/MIN; ``group`` any subgroup this rank belongs to. Time in the alpha-beta
    model: ``2(p-1) * alpha + 2(p-1)/p * D * beta``. Extra memory: two chunk-sized buffers,
    reused across calls. Result equals ``dist.all_reduce`` up to summation order (float32)
    or is closer to the exact sum than it (16-bit floats, see the module docstring).
    """
    what = "ring_all_reduce"
    rank, p = group_rank_and_size(group)
    n = tensor.numel()
    problem = local_problem(what, {"tensor": tensor}, op)
    agree(what, {"numel": n, **op_dtype_fields(op, tensor.dtype)}, problem, group, tensor.device, pool, check=check)
    if p == 1 or n == 0:
        return tensor
    flat = tensor.view(-1)
    start, stop = chunk_offsets(n, p)[rank : rank + 2]
    gather = _RingAllGather(flat, group, block)
    _reduce_scatter_core(flat[start:stop], flat, op, group, pool, trace, block, gather)
    gather.run(trace, own_sent=True)
    return tensor
