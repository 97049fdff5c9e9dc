"""Megatron's parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

A linear layer Y = X A^T + b (PyTorch stores A as (out, in)) splits two ways across t ranks
(Shoeybi et al. 2019, section 3):

* **by columns of the output** (rows of A): rank r holds A_r (out/t, in) and b_r and computes
  Y_r = f(X) A_r^T + b_r, its own out/t features; nothing is summed, so the forward needs no
  communication. f (identity forward, all-reduce backward) gives dL/dX = sum_r dL/dY_r A_r.
* **by rows of the input** (columns of A): rank r holds A_r (out, in/t) and the matching
  features X_r; sum_r X_r A_r^T is the full product, so g (all-reduce forward, identity
  backward) sums the partials. The bias is added once, *after* the sum.

Column then row (the MLP's d -> 4d -> d, attention's q/k/v -> proj) needs no communication in
between: the column layer's sharded output is exactly the row layer's sharded input.

Every sharded parameter records ``tp_shard_dim`` (the dim it was split along) so the full
tensor can be rebuilt by an all-gather (:func:`labkit.tensor_parallel.transform.gather_full`).
Parameters without it are replicated on every tensor-parallel rank.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from labkit.collectives import Comm
from labkit.tensor_parallel.mappings import (
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    reduce_scatter_to_sp,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "shard_rows"]

INPUT_MODES = ("copy", "gather", "none")  # f, SP all-gather, or the caller already did it
OUTPUT_MODES = ("reduce", "reduce_scatter")  # g, or SP reduce-scatter


def shard_rows(t: torch.Tensor, rank: int, world_size: int, dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s contiguous 1/world_size slice of ``t`` along ``dim`` (a detached copy)."""
    size = t.shape[dim]
    if size % world_size:
        raise ValueError(f"dimension {dim} of size {size} is not divisible by tp={world_size}")
    n = size // world_size
    return t.detach().narrow(dim, rank * n, n).clone()


def _param(t: torch.Tensor, shard_dim: int | None) -> nn.Parameter:
    p = nn.Parameter(t)
    p.tp_shard_dim = shard_dim  # type: ignore[attr-defined]
    return p


class ColumnParallelLinear(nn.Module):
    """Y_r = f(X) A_r^T + b_r with A_r = rows [r out/t, (r+1) out/t) of A.

    ``out_features`` is the *local* width out/t (the attention reads its head count from it);
    ``input_mode``: "copy" applies f, "gather" the SP all-gather, "none" leaves it to the
    caller (one f in front of q, k and v together, as Megatron's fused QKV does).
    """

    def __init__(self, linear: nn.Linear, comm: Comm, input_mode: str = "copy") -> None:
        super().__init__()
        if input_mode not in INPUT_MODES:
            raise ValueError(f"input_mode={input_mode!r}; expected one of {INPUT_MODES}")
        r, t = comm.rank, comm.world_size
        self.comm, self.input_mode = comm, input_mode
        self.weight = _param(shard_rows(linear.weight, r, t), 0)  # (out/t, in)
        self.in_features, self.out_features = linear.in_features, self.weight.shape[0]
        self.bias = None if linear.bias is None else _param(shard_rows(linear.bias, r, t), 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_mode == "copy":
            x = copy_to_tp(x, self.comm)
        elif self.input_mode == "gather":
            x = gather_from_sp(x, self.comm)
        return F.linear(x, self.weight, self.bias)  # (..., out/t): no communication


class RowParallelLinear(nn.Module):
    """Y = g(X_r A_r^T) + b with A_r = columns [r in/t, (r+1) in/t) of A; b replicated.

    With ``output_mode="reduce_scatter"`` (sequence parallelism) the partial sums are
    reduce-scattered along the sequence instead, and b is added to this rank's tokens only,
    so b's gradient is partial and must be summed over the group once per step.
    """

    def __init__(self, linear: nn.Linear, comm: Comm, output_mode: str = "reduce") -> None:
        super().__init__()
        if output_mode not in OUTPUT_MODES:
            raise ValueError(f"output_mode={output_mode!r}; expected one of {OUTPUT_MODES}")
        r, t = comm.rank, comm.world_size
        self.comm, self.output_mode = comm, output_mode
        self.in_features = linear.in_features // t
        self.out_features = linear.out_features
        self.weight = _param(shard_rows(linear.weight, r, t, dim=1), 1)  # (out, in/t)
        self.bias = None if linear.bias is None else _param(linear.bias.detach().clone(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)  # (..., out): this rank's share of the sum
        if self.output_mode == "reduce":
            y = reduce_from_tp(partial, self.comm)
        else:
            y = reduce_scatter_to_sp(partial, self.comm)
        return y if self.bias is None else y + self.bias  # after the sum: added exactly once


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r V/t, (r+1) V/t) of the table (V/t, d).

    A token id outside this rank's range looks up row 0 and is then zeroed, so exactly one
    rank contributes each token's vector; summing over ranks (g, or the SP reduce-scatter)
    gives the full lookup. The head may share ``weight``: a vocab-parallel output layer is a
    column-parallel linear with the same row split (Megatron ties them this way).
    """

    def __init__(self, embedding: nn.Embedding, comm: Comm, output_mode: str = "reduce") -> None:
        super().__init__()
        if output_mode not in OUTPUT_MODES:
            raise ValueError(f"output_mode={output_mode!r}; expected one of {OUTPUT_MODES}")
        r, t = comm.rank, comm.world_size
        self.comm, self.output_mode = comm, output_mode
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.vocab_start = r * (embedding.num_embeddings // t)
        self.weight = _param(shard_rows(embedding.weight, r, t), 0)  # (V/t, d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])  # (B, T): another rank's token
        partial = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, d)
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.output_mode == "reduce":
            return reduce_from_tp(partial, self.comm)
        return reduce_scatter_to_sp(partial, self.comm)  # (B, T/t, d)
