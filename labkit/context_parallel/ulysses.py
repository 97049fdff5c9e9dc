"""DeepSpeed-Ulysses (Jacobs et al. 2023): trade the sequence split for a head split.

Each of the ``cp`` ranks holds a contiguous ``s/cp`` slice of the sequence for all ``h``
heads. One all-to-all per tensor turns that into all ``s`` positions for ``h/cp`` heads
(:func:`seq_to_heads`); attention then runs locally and unchanged (any kernel, any mask: a
head never needs another head), and one all-to-all turns the output back
(:func:`heads_to_seq`). Four all-to-alls forward (Q, K, V, O), four backward.

When it beats the ring (arithmetic in :mod:`labkit.context_parallel.cost`):

* bytes: an all-to-all sends ``(cp-1)/cp`` of a tensor of ``b*h*(s/cp)*d`` elements, so Ulysses
  sends ``4 (cp-1)/cp`` such tensors per layer forward; the ring sends ``2 (cp-1)`` of them
  (K and V at every step). Ulysses' volume per rank stays flat as ``cp`` grows, the ring's
  grows linearly, but the ring's is hidden behind compute while Ulysses' all-to-all is not;
* limits: ``cp`` must divide the head count (and ``h / tp`` under tensor parallelism; with
  grouped-query attention the KV heads), so Ulysses stops at ``cp = h``; the ring does not
  care about heads and also fits the sequence's memory as ``cp`` grows;
* links: an all-to-all wants full bisection bandwidth (NVLink inside a node); the ring talks
  only to neighbours, fine across nodes. Hence the usual hybrid: Ulysses inside a node, the
  ring across nodes.

The all-to-alls are ``dist.all_to_all_single`` (a collective: NCCL-safe by construction),
wrapped in autograd Functions whose backward is the inverse exchange.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

__all__ = ["heads_to_seq", "seq_to_heads", "ulysses_attention"]


def _a2a(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Block j of dim 0 goes to rank j; block i of the result came from rank i."""
    x = x.contiguous()
    out = torch.empty_like(x)  # of a contiguous tensor: empty_like keeps a permuted one's strides
    dist.all_to_all_single(out, x, group=group)
    return out


def _to_heads(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    p = dist.get_world_size(group)
    b, h, n, d = x.shape
    blocks = x.reshape(b, p, h // p, n, d).transpose(0, 1)  # (p, b, h/p, n, d): heads j -> rank j
    got = _a2a(blocks, group)  # (p, b, h/p, n, d): sequence chunk i from rank i
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // p, p * n, d)


def _to_seq(y: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    p = dist.get_world_size(group)
    b, hp, s, d = y.shape
    blocks = y.reshape(b, hp, p, s // p, d).permute(2, 0, 1, 3, 4)  # (p, b, h/p, s/p, d)
    got = _a2a(blocks, group)  # (p, b, h/p, s/p, d): head group i from rank i
    return got.transpose(0, 1).reshape(b, p * hp, s // p, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _to_heads(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):  # type: ignore[override]
        return _to_seq(g, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _to_seq(y, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):  # type: ignore[override]
        return _to_heads(g, ctx.group), None


def _check_heads(heads: int, group: ProcessGroup | None) -> None:
    p = dist.get_world_size(group)
    if heads % p:
        raise ValueError(
            f"Ulysses needs the head count divisible by cp: {heads} heads over cp={p} ranks "
            f"(use the ring, or a cp that divides {heads})"
        )


def seq_to_heads(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """(b, h, s/cp, d) sequence-sharded -> (b, h/cp, s, d) head-sharded (differentiable)."""
    _check_heads(x.shape[1], group)
    out: torch.Tensor = _SeqToHeads.apply(x, group)
    return out


def heads_to_seq(y: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """(b, h/cp, s, d) head-sharded -> (b, h, s/cp, d) sequence-sharded (differentiable)."""
    out: torch.Tensor = _HeadsToSeq.apply(y, group)
    return out


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: ProcessGroup | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of (b, h, s/cp, d) contiguous sequence shards (rank r holds slice r); the
    local attention is torch's ``scaled_dot_product_attention`` on (b, h/cp, s, d)."""
    _check_heads(q.shape[1], group)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    qh, kh, vh = (seq_to_heads(t, group) for t in (q, k, v))
    o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale)
    return heads_to_seq(o, group)
