"""Ring attention (Liu, Zaharia & Abbeel 2023): each rank keeps its queries, K/V blocks travel.

Each of the ``cp`` ranks of ``group`` holds two sequence chunks of Q, K and V
(:mod:`labkit.context_parallel.split`). Forward, step ``t = 0 .. cp-1``: the rank holds the
K/V of rank ``r - t``; it *first* posts the send of that block to ``r + 1`` and the receive
of the next from ``r - 1`` (one ``batch_isend_irecv`` through
:func:`labkit.collectives.common.post`, the order NCCL cannot deadlock on), *then* computes
its queries against the block (so the transfer overlaps the compute), merges the partial
result by the log-sum-exp rule (:func:`~labkit.context_parallel.blockwise.merge`), and waits.
After ``cp`` steps every query has seen every key; bytes each rank sends per step: K and V of
its shard, ``2 * b * h * (s/cp) * d * elem`` (:mod:`labkit.context_parallel.cost`).

Backward (an ``autograd.Function``; nothing but Q, K, V, O and the (b, h, s/cp) LSE is
saved): K/V travel the ring again; the gradient of each K/V block travels *with* it, one step
behind: at step ``t`` a rank posts the K/V prefetch and the send of the block gradient it
finished at step ``t-1`` before computing its own contribution, so both overlap the compute;
after the last step each accumulated dK/dV takes one more hop home to its owner. Gradients,
outputs and the LSE are kept in float32 (float64 for float64 inputs: ``blockwise.acc_dtype``,
which the fused kernel's float64 backward requires). dQ stays local. No score matrix larger
than a ``(s/2cp) x (s/2cp)`` tile exists at any time.

Causal masking is decided per chunk pair (:func:`~labkit.context_parallel.split.pair_kind`):
tiles wholly in the future are skipped, which is where the contiguous split's imbalance comes
from and what the zigzag split evens out.

Off the happy path (:mod:`labkit.collectives.guard`): every rank first checks, once per shape
(cached), that all ranks hold the same Q/K/V shape, dtype, mask, split, kernel and scale, so
a rank with 4 positions against one with 6 is a ValueError on both, not gloo's abort; and a
tile that raises half-way (forward or backward) puts its rank in send-only mode for the rest
of the ring, so every posted message is matched and every rank raises at the end.
"""

from __future__ import annotations

import math
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from labkit.collectives.common import post, ring_neighbours
from labkit.collectives.guard import guarded, same_everywhere
from labkit.context_parallel.blockwise import (
    acc_dtype,
    fused_tiles,
    merge,
    tile_backward,
    tile_forward,
)
from labkit.context_parallel.split import SCHEMES, chunk_ids, pair_kind

__all__ = ["KERNELS", "RingAttention", "RingStats", "ring_attention", "tile_pairs"]

KERNELS = ("auto", "fused", "reference")


@dataclass
class RingStats:
    """What one rank's ring did, filled in when passed to :func:`ring_attention`.

    ``sent`` and ``tiles``: bytes sent and score tiles computed at each step (forward steps
    first, then backward steps, then the final gradient hop); ``events``: ``(phase, step,
    what, perf_counter seconds)`` for the ring picture ("post", "compute", "computed", "waited").
    """

    sent: list[int] = field(default_factory=list)
    tiles: list[int] = field(default_factory=list)
    events: list[tuple[str, int, str, float]] = field(default_factory=list)

    def mark(self, phase: str, step: int, what: str) -> None:
        self.events.append((phase, step, what, time.perf_counter()))


def tile_pairs(mine: tuple[int, int], theirs: tuple[int, int], causal: bool, c: int):
    """(query slice, key slice, is it a diagonal tile) for every chunk pair not skipped."""
    for qi, q_chunk in enumerate(mine):
        for ki, k_chunk in enumerate(theirs):
            kind = pair_kind(q_chunk, k_chunk, causal)
            if kind != "skip":
                qs, ks = slice(qi * c, (qi + 1) * c), slice(ki * c, (ki + 1) * c)
                yield qs, ks, kind == "diag"


def _problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scheme: str, kernel: str):
    """What is wrong with this rank's arguments, found without talking (or None)."""
    if scheme not in SCHEMES:
        return f"scheme {scheme!r} is not one of {SCHEMES}"
    if kernel not in KERNELS:
        return f"kernel {kernel!r} is not one of {KERNELS}"
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        return (
            f"q, k, v must share one (batch, heads, local seq, head dim) shape; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    n = q.shape[-2]
    if n % 2 or n == 0:
        return (
            f"local sequence length {n} is not even: the full sequence must be divisible by "
            f"2 x cp (each rank holds two equal chunks; use shard_sequence)"
        )
    return None


def _check(q, k, v, group, causal, scheme, kernel, scale) -> None:
    """Raise the same ValueError on every rank of ``group`` unless every rank's q, k, v are
    valid and equal in shape and dtype, with the same causal, scheme, kernel and scale (the
    ring's messages are K/V blocks of this shape: a rank with another shape would abort gloo
    or hang NCCL). Cached: repeated shapes exchange nothing. No process group: local only."""
    problem = _problem(q, k, v, scheme, kernel)
    if not dist.is_initialized():
        if problem is not None:
            raise ValueError(problem)
        return
    codes = {
        "causal": int(causal),
        "scheme (index in SCHEMES)": SCHEMES.index(scheme) if scheme in SCHEMES else -1,
        "kernel (index in KERNELS)": KERNELS.index(kernel) if kernel in KERNELS else -1,
        "scale (float64 bits)": struct.unpack("<q", struct.pack("<d", float(scale)))[0],
    }
    # with a problem, k and v may be anything: q stands in, so every row has one length
    tensors = {"q": q, "k": q, "v": q} if problem else {"q": q, "k": k, "v": v}
    same_everywhere("ring_attention", group, tensors, codes, problem=problem)


def _forward(q, k, v, group, causal, scheme, scale, stats, overlap, fused):
    rank, cp, right, left = ring_neighbours(group)
    mine, c = chunk_ids(rank, cp, scheme), q.shape[-2] // 2
    acc = acc_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)  # (b, h, 2c)
    kv = torch.stack([k, v])  # (2, b, h, 2c, d): one message per step
    with guarded("ring_attention", group, q.device) as g:  # a failed step: send-only mode
        for t in range(cp):
            owner = (rank - t) % cp
            works: list[Any] = []
            nxt = kv
            if t < cp - 1:  # post the next block's transfer BEFORE computing on this one
                nxt = torch.empty_like(kv)
                recv_w, send_w = post([(kv, right)], [(nxt, left)], group)
                works = recv_w + send_w
                if stats is not None:
                    stats.mark("fwd", t, "post")
                    stats.sent.append(kv.numel() * kv.element_size())
                if not overlap:  # measure what overlap buys: wait before computing
                    for w in works:
                        w.wait()
                    works = []  # waiting twice on a gloo p2p handle hung here: wait once
            if g.ok:
                with g.catch():
                    _forward_tiles(q, kv, out, lse, mine, owner, cp, c, (causal, scheme, scale),
                                   stats, t, fused)  # fmt: skip
            for w in works:
                w.wait()
            if stats is not None and works:
                stats.mark("fwd", t, "waited")
            kv = nxt
    return out.to(q.dtype), lse


def _forward_tiles(q, kv, out, lse, mine, owner, cp, c, how, stats, t, fused) -> None:
    """This rank's queries against block ``owner``'s keys, merged into ``out``/``lse``."""
    causal, scheme, scale = how
    if stats is not None:
        stats.mark("fwd", t, "compute")
    tiles = 0
    for qs, ks, is_diag in tile_pairs(mine, chunk_ids(owner, cp, scheme), causal, c):
        o, l_ = tile_forward(q[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :], scale,
                             is_diag, fused)  # fmt: skip
        out[..., qs, :], lse[..., qs] = merge(out[..., qs, :], lse[..., qs], o, l_)
        tiles += 1
    if stats is not None:
        stats.tiles.append(tiles)
        stats.mark("fwd", t, "computed")


def _backward_tiles(saved, kv, grad, mine, owner, cp, c, how, stats, t, fused) -> None:
    """This rank's share of block ``owner``'s gradient (into ``grad``) and of its dQ."""
    (q, dout, out, lse, delta, dq), (causal, scheme, scale) = saved, how
    if stats is not None:
        stats.mark("bwd", t, "compute")
    tiles = 0
    for qs, ks, is_diag in tile_pairs(mine, chunk_ids(owner, cp, scheme), causal, c):
        dq_, dk_, dv_ = tile_backward(
            q[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :], dout[..., qs, :],
            out[..., qs, :], lse[..., qs], delta[..., qs], scale, is_diag, fused,
        )  # fmt: skip
        dq[..., qs, :] += dq_
        grad[0][..., ks, :] += dk_
        grad[1][..., ks, :] += dv_
        tiles += 1
    if stats is not None:
        stats.tiles.append(tiles)
        stats.mark("bwd", t, "computed")


def _backward(dout, q, k, v, out, lse, group, causal, scheme, scale, stats, fused):
    rank, cp, right, left = ring_neighbours(group)
    mine, c = chunk_ids(rank, cp, scheme), q.shape[-2] // 2
    acc = acc_dtype(q.dtype)
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # (b, h, 2c): D = rowsum(dO * O)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.stack([k, v])
    done = torch.zeros((2, *q.shape), dtype=acc, device=q.device)  # (2, b, h, 2c, d)
    with guarded("ring_attention backward", group, q.device) as g:
        for t in range(cp):
            owner = (rank - t) % cp
            sends, recvs, nxt, g_in = [], [], kv, None
            if t < cp - 1:  # prefetch the next K/V block
                nxt = torch.empty_like(kv)
                sends.append((kv, right))
                recvs.append((nxt, left))
            if t > 0:  # the previous block's gradient moves on; this block's arrives
                g_in = torch.empty_like(done)
                sends.append((done, right))
                recvs.append((g_in, left))
            recv_w, send_w = post(sends, recvs, group)
            if stats is not None:
                stats.mark("bwd", t, "post")
                stats.sent.append(sum(s.numel() * s.element_size() for s, _ in sends))
            grad = torch.zeros_like(done)  # this rank's contribution to block `owner`
            if g.ok:
                with g.catch():
                    saved = (q, dout, out, lse, delta, dq)
                    _backward_tiles(saved, kv, grad, mine, owner, cp, c, (causal, scheme, scale),
                                    stats, t, fused)  # fmt: skip
            for w in recv_w + send_w:
                w.wait()
            if stats is not None:
                stats.mark("bwd", t, "waited")
            done = grad if g_in is None else grad.add_(g_in)
            kv = nxt
        if cp > 1:  # the last block's gradient goes home: rank r+1 owns what rank r holds now
            home = torch.empty_like(done)
            recv_w, send_w = post([(done, right)], [(home, left)], group)
            for w in recv_w + send_w:
                w.wait()
            if stats is not None:
                stats.sent.append(done.numel() * done.element_size())
            done = home
    return dq.to(q.dtype), done[0].to(k.dtype), done[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Autograd wrapper: forward and backward rings above; saves Q, K, V, O and the LSE."""

    @staticmethod
    def forward(ctx: Any, q, k, v, group, causal, scheme, scale, stats, overlap, fused):  # type: ignore[override]
        out, lse = _forward(q, k, v, group, causal, scheme, scale, stats, overlap, fused)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, causal, scheme, scale, stats, fused)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: ProcessGroup | None = None,
    causal: bool = False,
    scheme: str = "zigzag",
    scale: float | None = None,
    stats: RingStats | None = None,
    overlap: bool = True,
    kernel: str = "auto",
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, held as ``cp`` shards.

    ``q``, ``k``, ``v``: (batch, heads, 2c, head_dim), this rank's two chunks in ``scheme``'s
    order (:func:`~labkit.context_parallel.split.shard_sequence`); the full sequence is
    ``2c * cp`` long. ``group`` is the cp group (None = WORLD; pass ``layout.cp_group`` when
    composing). Every rank must call with the same shapes. ``overlap=False`` waits for each
    transfer before computing (to measure what overlap buys). ``kernel``: "reference" computes
    each tile with :func:`~labkit.context_parallel.blockwise.block_forward` (readable
    float32 torch ops), "fused" with torch's fused CPU flash kernel (same terms, about 10x
    faster), "auto" the fused one where it exists. Returns (b, h, 2c, d).
    """
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    _check(q, k, v, group, causal, scheme, kernel, scale)
    fused = kernel == "fused" or (kernel == "auto" and fused_tiles(q))
    out: torch.Tensor = RingAttention.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), group, causal, scheme, scale, stats,
        overlap, fused,
    )  # fmt: skip
    return out
