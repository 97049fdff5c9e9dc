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
wrapped in autograd Functions whose backward is the inverse exchange. Off the happy path: the
shapes are checked on every rank first (cached: 13 rows against 12 is a ValueError on both,
not gloo's abort), and :func:`ulysses_attention` is one Function whose local attention, forward
or backward, runs as a compute step of a guard (:mod:`labkit.collectives.guard`): a rank whose
attention raises still takes part in every remaining all-to-all, and every rank raises.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from labkit.collectives.guard import guarded, same_everywhere

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


def _local_attention(qh, kh, vh, causal: bool, scale: float) -> torch.Tensor:
    """The head-sharded attention every rank runs alone: torch's SDPA on (b, h/cp, s, d)."""
    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale)


def _local_grads(o: torch.Tensor, heads: list[torch.Tensor], d_o: torch.Tensor):
    """The local attention's backward: gradients of the head-sharded q, k, v."""
    return torch.autograd.grad(o, heads, d_o)


class _Ulysses(torch.autograd.Function):
    """Forward: three all-to-alls, local attention, one back; backward: the same in reverse.
    One Function, so a local attention that raises (forward or backward) is a compute step
    of a guard (:mod:`labkit.collectives.guard`): its rank still takes part in every
    remaining all-to-all, with zeros, and every rank raises at the end."""

    @staticmethod
    def forward(ctx: Any, q, k, v, group, causal, scale):  # type: ignore[override]
        with guarded("ulysses_attention", group, q.device) as g:
            heads = [_to_heads(t, group).detach().requires_grad_() for t in (q, k, v)]
            with torch.enable_grad():  # the local graph, kept for backward
                o = g.run(_local_attention, *heads, causal, scale, default=None)
            out = _to_seq(torch.zeros_like(heads[0]) if o is None else o.detach(), group)
        ctx.group, ctx.heads, ctx.o = group, heads, o
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor):  # type: ignore[override]
        group, heads = ctx.group, ctx.heads
        with guarded("ulysses_attention backward", group, dout.device) as g:
            d_o = _to_heads(dout, group)  # (b, h/cp, s, d)
            grads = g.run(_local_grads, ctx.o, heads, d_o, default=None)
            if grads is None:
                grads = [torch.zeros_like(t) for t in heads]
            dq, dk, dv = (_to_seq(t, group) for t in grads)
        ctx.heads = ctx.o = None
        return dq, dk, dv, None, None, None


def _check(what: str, group: ProcessGroup | None, x: dict[str, torch.Tensor], **fields: int):
    """The same shapes and dtypes on every rank (cached; a ValueError on every rank, never
    gloo's abort), heads divisible by cp, and for head shards the sequence too."""
    p = dist.get_world_size(group)
    t = next(iter(x.values()))
    problem = None
    if t.dim() != 4:
        problem = f"expected (batch, heads, seq, head dim) tensors, got shape {tuple(t.shape)}"
    elif what != "heads_to_seq" and t.shape[1] % p:
        problem = (
            f"Ulysses needs the head count divisible by cp: {t.shape[1]} heads over cp={p} "
            f"ranks (use the ring, or a cp that divides {t.shape[1]})"
        )
    elif what == "heads_to_seq" and t.shape[2] % p:
        problem = f"sequence {t.shape[2]} is not divisible by cp={p}"
    same_everywhere(what, group, x, fields, problem=problem)


def seq_to_heads(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """(b, h, s/cp, d) sequence-sharded -> (b, h/cp, s, d) head-sharded (differentiable)."""
    _check("seq_to_heads", group, {"x": x})
    out: torch.Tensor = _SeqToHeads.apply(x, group)
    return out


def heads_to_seq(y: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """(b, h/cp, s, d) head-sharded -> (b, h, s/cp, d) sequence-sharded (differentiable)."""
    _check("heads_to_seq", group, {"y": y})
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
    local attention is torch's ``scaled_dot_product_attention`` on (b, h/cp, s, d). Every
    rank must pass the same shapes (checked on every rank, once per shape)."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    bits = struct.unpack("<q", struct.pack("<d", float(scale)))[0]
    tensors = {"q": q, "k": k, "v": v}
    _check("ulysses_attention", group, tensors, causal=int(causal), scale_bits=bits)
    out: torch.Tensor = _Ulysses.apply(q, k, v, group, causal, scale)
    return out
