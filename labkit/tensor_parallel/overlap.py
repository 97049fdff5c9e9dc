"""Tensor-parallel communication hidden under the matmuls that need it ("collective matmul").

Under sequence parallelism (Korthikanti et al. 2022) a column-parallel linear starts with an
all-gather of the (B, T/t, d) sequence shards and a row-parallel one ends with a
reduce-scatter of (B, T, d) partial sums: both exposed, the GEMM waits for the whole gather.
Wang et al. 2023 ("Overlap communication with dependent computation via decomposition",
the XLA collective matmul; PyTorch's async-TP is the same idea) cut each collective into its
``t - 1`` ring steps and give every step a slice of the GEMM to hide behind:

* **all-gather then matmul** (:func:`all_gather_matmul`). Step ``s = 0 .. t-1``: rank r holds
  chunk ``k = r - s`` (mod t) of the sequence; it posts the send of that chunk to r + 1 and
  the receive of chunk ``r - s - 1`` from r - 1, THEN multiplies chunk k, then waits. The
  last step has nothing left to receive. ``t - 1`` transfers, each under a 1/t GEMM.
* **matmul then reduce-scatter** (:func:`matmul_reduce_scatter`). Step s: rank r computes its
  partial product for chunk ``k = r - s - 1`` while the running sum of step s - 1 travels,
  waits for it, adds its partial to it (arrived sum first, the ring's order) and sends the
  sum on. The sum of chunk k starts at rank k + 1 and ends at rank k after ``t - 1`` hops.
  ``t - 1`` transfers, each under the next step's 1/t GEMM: the first step has no transfer to
  hide, so one chunk of GEMM is always exposed compute-wise, and on a slow link the last
  transfer's excess is never hidden (``labkit.planner.tp_overlap`` prices it).

Backward mirrors it: the gradient of all-gather-matmul is matmul-reduce-scatter (dX) and vice
versa. The column layer's backward rides the re-gather of its input X (kept as a shard only,
as SP does) on the same ring steps as the dX reduce-scatter, so dW = dY^T X is computed once
the last chunk is in. dW is one GEMM over the gathered tensors, in the (B, T) row order the
plain layer uses, so it is the same sum in the same order.

Equality: every output row is one dot product over the same K in both layers, and the sums of
the reduce-scatter are added in labkit's ring order, so the result equals the plain SP layer's
(``Comm(impl="ring")``, or torch's at t = 2) bit for bit in float32 as long as the CPU GEMM
computes a row the same in a chunk as in the whole (measured here: chunks of >= 4 rows and
output widths >= 12; narrower products take an MKL kernel whose rounding depends on the row's
position, ~1 ulp).

Off the happy path, with :mod:`labkit.collectives.guard`: sizes are compared on every rank
first (``same_everywhere``, cached), so a mismatch is the same ValueError everywhere; if a
chunk's compute raises, this rank keeps posting and waiting for every message of the schedule
and skips only its compute (``guarded``), then every rank learns it in one tiny exchange: the
failing rank re-raises, the others raise ``PeerFailed``, and the group is usable for the next
call (one latency per call for that exchange).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn import functional as F

from labkit.collectives import Comm
from labkit.collectives.guard import guarded, same_everywhere
from labkit.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from labkit.tensor_parallel.overlap_ring import RingSteps, Timeline
from labkit.tensor_parallel.overlap_schedule import Order, ag_order, rs_order

__all__ = [
    "OverlappedColumnLinear",
    "OverlappedRowLinear",
    "all_gather_linear",
    "all_gather_matmul",
    "linear_reduce_scatter",
    "matmul_reduce_scatter",
]

Chunked = Callable[[int, torch.Tensor], None]  # (chunk index, its rows) -> writes its products


def all_gather_matmul(
    shard: torch.Tensor, compute: Chunked, ring: RingSteps, order: Order = ag_order
) -> torch.Tensor:
    """Gather the (n, B, d) sequence-first shards into (t n, B, d) and call ``compute(k, rows)``
    on every chunk k, each while the next chunk travels (``order``: which chunk at each step,
    :mod:`~labkit.tensor_parallel.overlap_schedule`). Returns the gathered tensor."""
    t, n = ring.size, shard.shape[0]
    chunk_at = order(ring.rank, t)
    full = shard.new_empty(t * n, *shard.shape[1:])  # (T, B, d)
    rows = [full[k * n : (k + 1) * n] for k in range(t)]  # contiguous views: chunk k
    rows[ring.rank].copy_(shard)
    with guarded("all_gather_matmul", ring.group, shard.device) as g, ring:
        for s, k in enumerate(chunk_at):
            if s < t - 1:  # post the next chunk's transfer BEFORE multiplying this one
                ring.start(s, sends=[rows[k]], recvs=[rows[chunk_at[s + 1]]])
            if g.ok:  # after a failure on this rank: keep forwarding, compute nothing
                with g.catch():
                    ring.mark(s, "compute")
                    compute(k, rows[k])
                    ring.mark(s, "computed")
            if s < t - 1:
                ring.wait(s)
    return full


def matmul_reduce_scatter(
    full: torch.Tensor, partial: Callable[[torch.Tensor], torch.Tensor], width: int,
    ring: RingSteps, carry: torch.Tensor | None = None, order: Order = rs_order,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Chunk ``rank`` of SUM over ranks of ``partial(rows)`` ((n, B, width) for the (n, B, .)
    row chunks of the (T, B, .) ``full``), each partial computed while the previous sum
    travels. ``carry``: a (n, B, .) shard all-gathered on the same steps (the column layer's
    backward re-gathers its input this way). Returns (the reduced chunk, the gathered carry)."""
    t, n = ring.size, full.shape[0] // ring.size
    chunks = [full[k * n : (k + 1) * n] for k in range(t)]  # contiguous views: chunk k
    gathered, rows = None, []
    if carry is not None:
        gathered = carry.new_empty(t * n, *carry.shape[1:])  # (T, B, .)
        rows = [gathered[k * n : (k + 1) * n] for k in range(t)]
        rows[ring.rank].copy_(carry)
    shape = (n, full.shape[1], width)
    arrived = [full.new_empty(shape), full.new_empty(shape)]  # alternate: one may be in flight
    total = arrived[0]
    with guarded("matmul_reduce_scatter", ring.group, full.device) as g, ring:
        for s, k in enumerate(order(ring.rank, t)):
            ring.mark(s, "compute")
            mine = g.run(partial, chunks[k], default=None)  # overlaps step s - 1's transfer
            ring.mark(s, "computed")
            if mine is None:  # this rank failed: send-only mode, every rank raises at the end
                mine = full.new_zeros(shape)
            if s > 0:
                ring.wait(s - 1)
                total = arrived[(s - 1) % 2].add_(mine)  # arrived sum first: the ring's order
            else:
                total = mine
            if s < t - 1:
                sends, recvs = [total], [arrived[s % 2]]
                if gathered is not None:  # the carried gather rides along: chunk r - s
                    sends.append(rows[(ring.rank - s) % t])
                    recvs.append(rows[(ring.rank - s - 1) % t])
                ring.start(s, sends, recvs)
    return total, gathered


def _seq_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).contiguous()  # (B, T, d) -> (T, B, d): sequence chunks contiguous


class _AllGatherLinear(torch.autograd.Function):
    """F.linear(all_gather_seq(x), W, b), the gather overlapped; backward: dX by an overlapped
    reduce-scatter that re-gathers x on the same steps, then dW and db."""

    @staticmethod
    def forward(ctx: Any, x, weight, bias, group, timeline):  # type: ignore[override]
        B, n, d = x.shape
        shard = _seq_first(x)  # (n, B, d)
        out = x.new_empty(n * _size(group), B, weight.shape[0])  # (T, B, o/t)

        def compute(k: int, rows: torch.Tensor) -> None:
            out[k * n : (k + 1) * n] = F.linear(rows, weight, bias)  # (n, B, o/t)

        all_gather_matmul(shard, compute, RingSteps(group, "ag_fwd", timeline))
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.timeline, ctx.has_bias = group, timeline, bias is not None
        return out.transpose(0, 1).contiguous()  # (T, B, o/t) -> (B, T, o/t)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()  # (B, T, o/t)
        ring = RingSteps(ctx.group, "rs_bwd", ctx.timeline)
        dx, xs = matmul_reduce_scatter(_seq_first(dy), lambda r: r @ weight, x.shape[-1], ring,
                                       carry=_seq_first(x))  # fmt: skip
        assert xs is not None
        o = dy.shape[-1]
        x_full = xs.transpose(0, 1).contiguous()  # (B, T, d): the plain layer's row order
        dw = dy.reshape(-1, o).t() @ x_full.reshape(-1, x_full.shape[-1])  # (o/t, d)
        db = dy.sum((0, 1)) if ctx.has_bias else None
        return dx.transpose(0, 1).contiguous(), dw, db, None, None  # dx: (B, T/t, d)


class _LinearReduceScatter(torch.autograd.Function):
    """reduce_scatter_seq(F.linear(z, W)), the reduce-scatter overlapped; backward: an
    overlapped all-gather of dY under dZ = dY W, then dW."""

    @staticmethod
    def forward(ctx: Any, z, weight, group, timeline):  # type: ignore[override]
        ring = RingSteps(group, "rs_fwd", timeline)
        o = weight.shape[0]
        y, _ = matmul_reduce_scatter(_seq_first(z), lambda r: F.linear(r, weight), o, ring)
        ctx.save_for_backward(z, weight)
        ctx.group, ctx.timeline = group, timeline
        return y.transpose(0, 1).contiguous()  # (T/t, B, o) -> (B, T/t, o)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        z, weight = ctx.saved_tensors
        B, n, o = dy.shape
        dz = z.new_empty(n * _size(ctx.group), B, z.shape[-1])  # (T, B, i/t)

        def compute(k: int, rows: torch.Tensor) -> None:
            dz[k * n : (k + 1) * n] = rows @ weight  # (n, B, o) @ (o, i/t)

        ring = RingSteps(ctx.group, "ag_bwd", ctx.timeline)
        dy_full = all_gather_matmul(_seq_first(dy), compute, ring).transpose(0, 1).contiguous()
        dw = dy_full.reshape(-1, o).t() @ z.reshape(-1, z.shape[-1])  # (o, i/t)
        return dz.transpose(0, 1).contiguous(), dw, None, None  # dz: (B, T, i/t)


def _size(group: ProcessGroup | None) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)


def _check_sequence(what: str, x: torch.Tensor, group: ProcessGroup | None, sizes: dict[str, int],
                    seq: int) -> None:  # fmt: skip
    t = _size(group)
    problem = None
    if x.dim() != 3:
        problem = f"{what}: expected a (batch, seq, features) input, got shape {tuple(x.shape)}"
    elif seq % t:
        problem = f"{what}: sequence length {seq} is not divisible by tp={t} (sequence parallelism)"
    elif torch.is_autocast_enabled(x.device.type):  # the backward would mix dtypes
        problem = f"{what}: autocast is on; overlapped SP runs in the input's dtype (cast first)"
    same_everywhere(what, group, {"input": x}, sizes, problem=problem)


def all_gather_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    group: ProcessGroup | None = None, timeline: Timeline | None = None,
) -> torch.Tensor:  # fmt: skip
    """(B, T/t, d) shard -> (B, T, o/t) = F.linear(all-gathered x, weight, bias), overlapped."""
    sizes = {f"x dim {i}": int(s) for i, s in enumerate(x.shape)}
    _check_sequence("all_gather_linear", x, group, sizes, x.shape[1] * _size(group))
    out: torch.Tensor = _AllGatherLinear.apply(x, weight, bias, group, timeline)
    return out


def linear_reduce_scatter(
    z: torch.Tensor, weight: torch.Tensor, group: ProcessGroup | None = None,
    timeline: Timeline | None = None,
) -> torch.Tensor:  # fmt: skip
    """(B, T, i/t) -> (B, T/t, o): this rank's sequence chunk of the SUM of F.linear(z, weight)
    over ranks, overlapped (add the bias after it, as RowParallelLinear does)."""
    sizes = {f"z dim {i}": int(s) for i, s in enumerate(z.shape)}
    sizes["out features"] = int(weight.shape[0])
    _check_sequence("linear_reduce_scatter", z, group, sizes, z.shape[1] if z.dim() == 3 else 0)
    out: torch.Tensor = _LinearReduceScatter.apply(z, weight, group, timeline)
    return out


class OverlappedColumnLinear(ColumnParallelLinear):
    """ColumnParallelLinear with ``input_mode="gather"`` whose all-gather hides under its GEMM."""

    def __init__(self, linear: nn.Linear, comm: Comm, timeline: Timeline | None = None) -> None:
        super().__init__(linear, comm, input_mode="gather")
        self.timeline = timeline

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather_linear(x, self.weight, self.bias, self.comm.group, self.timeline)


class OverlappedRowLinear(RowParallelLinear):
    """RowParallelLinear with ``output_mode="reduce_scatter"`` whose reduce-scatter hides under
    its GEMM; the replicated bias is added to this rank's tokens after the sum."""

    def __init__(self, linear: nn.Linear, comm: Comm, timeline: Timeline | None = None) -> None:
        super().__init__(linear, comm, output_mode="reduce_scatter")
        self.timeline = timeline

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear_reduce_scatter(x, self.weight, self.comm.group, self.timeline)
        return y if self.bias is None else y + self.bias
