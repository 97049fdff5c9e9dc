"""The communication of tensor parallelism as autograd Functions: f, g and their SP forms.

Megatron-LM (Shoeybi et al. 2019, section 3, Figure 3) names two conjugate operators:

* ``f``: identity forward, all-reduce backward. It sits where a *replicated* activation enters
  a column-parallel matmul: every rank consumes the same X, so dL/dX is the SUM over ranks of
  each rank's partial dL/dX.
* ``g``: all-reduce forward, identity backward. It sits where a row-parallel matmul leaves
  partial sums: Y = sum_i X_i A_i. The upstream gradient dL/dY is already replicated, so
  backward passes it through untouched.

Sequence parallelism (Korthikanti et al. 2022, section 4.2.2) splits an all-reduce into its
two halves (a ring all-reduce *is* a reduce-scatter then an all-gather) and keeps the
activation between them sharded along the sequence:

* ``g_bar`` = all-gather along the sequence forward, reduce-scatter backward (replaces f);
* ``g_bar conjugate`` = reduce-scatter forward, all-gather backward (replaces g).

Every collective goes through a :class:`labkit.collectives.Comm`, so PyTorch's collectives and
labkit's ring are one switch and every byte is counted. Activations are (B, T, d) as in the
GPT; the sequence is dim 1, so the sequence collectives move it to dim 0 (the flat collectives
chunk along dim 0) and back.
"""

from __future__ import annotations

from typing import Any

import torch

from labkit.collectives import Comm

__all__ = [
    "copy_to_tp",
    "reduce_from_tp",
    "gather_from_sp",
    "reduce_scatter_to_sp",
    "all_gather_seq",
    "reduce_scatter_seq",
]


# --------------------------------------------------------------------- raw sequence collectives
def all_gather_seq(shard: torch.Tensor, comm: Comm) -> torch.Tensor:
    """(B, T/t, d) on each rank -> (B, T, d), rank r's shard at positions [r T/t, (r+1) T/t)."""
    B, Ts, d = shard.shape
    seq_first = shard.transpose(0, 1).contiguous()  # (T/t, B, d): the collective chunks dim 0
    full = seq_first.new_empty(Ts * comm.world_size, B, d)  # (T, B, d)
    comm.all_gather(full, seq_first)
    return full.transpose(0, 1).contiguous()  # (T, B, d) -> (B, T, d)


def reduce_scatter_seq(full: torch.Tensor, comm: Comm) -> torch.Tensor:
    """(B, T, d) partial sums on each rank -> (B, T/t, d): rank r's sequence chunk of the SUM."""
    B, T, d = full.shape
    t = comm.world_size
    if T % t:
        raise ValueError(f"sequence length {T} is not divisible by tp={t} (sequence parallelism)")
    seq_first = full.transpose(0, 1).contiguous()  # (T, B, d)
    shard = seq_first.new_empty(T // t, B, d)  # (T/t, B, d)
    comm.reduce_scatter(shard, seq_first)
    return shard.transpose(0, 1).contiguous()  # (T/t, B, d) -> (B, T/t, d)


# --------------------------------------------------------------------- f and g
class _CopyToTP(torch.autograd.Function):
    """f: identity forward; backward all-reduces dL/dX (each rank holds one partial sum)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)  # a new autograd node, same storage: f costs no memory

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()  # never reduce into a buffer autograd may reuse
        ctx.comm.all_reduce(grad)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (sum the row-parallel partial outputs); identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        out = x.contiguous().clone()
        comm.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromSP(torch.autograd.Function):
    """SP's f: all-gather the sequence shards forward; reduce-scatter dL/dX backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return all_gather_seq(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return reduce_scatter_seq(grad, ctx.comm), None


class _ReduceScatterToSP(torch.autograd.Function):
    """SP's g: reduce-scatter the partial sums forward; all-gather dL/dY backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return reduce_scatter_seq(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_gather_seq(grad, ctx.comm), None


def copy_to_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Megatron's f."""
    return _CopyToTP.apply(x, comm)


def reduce_from_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Megatron's g."""
    return _ReduceFromTP.apply(x, comm)


def gather_from_sp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Sequence parallelism's all-gather (forward) / reduce-scatter (backward)."""
    return _GatherFromSP.apply(x, comm)


def reduce_scatter_to_sp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Sequence parallelism's reduce-scatter (forward) / all-gather (backward)."""
    return _ReduceScatterToSP.apply(x, comm)
