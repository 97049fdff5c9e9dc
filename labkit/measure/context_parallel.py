"""Measurements of context parallelism: saved bytes, bytes per ring step, overlap, imbalance.

* Saved bytes: every tensor autograd keeps for the backward passes through
  ``torch.autograd.graph.saved_tensors_hooks``; summing the distinct storages gives exactly
  what an attention holds between forward and backward (inputs it saves included), to set
  against :mod:`labkit.context_parallel.cost`.
* Bytes per step: :class:`~labkit.context_parallel.ring.RingStats` counts what each step posts.
* Overlap: the ring forward with transfers posted before the compute, against the same ring
  waiting for each transfer first, the transfers alone and the compute alone, interleaved
  (:func:`labkit.measure.timing.interleaved_times`), medians. ``overlap = (comm + compute -
  overlapped) / min(comm, compute)``: 1 when the shorter one is hidden entirely, 0 when
  nothing is.
* Imbalance: forward compute seconds per rank under the contiguous and the zigzag split.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from labkit.collectives.common import post, ring_neighbours
from labkit.context_parallel import (
    RingStats,
    chunk_ids,
    merge,
    ring_attention,
    shard_sequence,
)
from labkit.context_parallel.blockwise import fused_tiles, tile_forward
from labkit.context_parallel.ring import tile_pairs
from labkit.measure.timing import interleaved_times

__all__ = [
    "full_attention_saved",
    "naive_attention",
    "overlap_fraction",
    "ring_measurements",
    "saved_bytes",
    "split_rounds",
]


def saved_bytes(fn: Callable[[], Any]) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn()`` runs."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    """Textbook attention: the (s, s) scores and probabilities materialised."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (b, h, s, s)
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _compute_only(q, k, v, cp, rank, causal, scheme):
    """The ring forward's tiles and merges with no transfer (this rank's own K/V stands in)."""
    c = q.shape[-2] // 2
    out = torch.zeros(q.shape)
    lse = torch.full(q.shape[:-1], float("-inf"))
    scale = 1 / math.sqrt(q.shape[-1])
    for t in range(cp):
        theirs = chunk_ids((rank - t) % cp, cp, scheme)
        for qs, ks, is_diag in tile_pairs(chunk_ids(rank, cp, scheme), theirs, causal, c):
            o, l_ = tile_forward(q[..., qs, :], k[..., ks, :], v[..., ks, :], scale, is_diag,
                                 fused_tiles(q))  # fmt: skip
            out[..., qs, :], lse[..., qs] = merge(out[..., qs, :], lse[..., qs], o, l_)
    return out


def _comm_only(kv: torch.Tensor, group: Any) -> None:
    """The ring forward's cp - 1 transfers, nothing computed."""
    _, cp, right, left = ring_neighbours(group)
    for _ in range(cp - 1):
        nxt = torch.empty_like(kv)
        recv_w, send_w = post([(kv, right)], [(nxt, left)], group)
        for w in recv_w + send_w:
            w.wait()
        kv = nxt


def split_rounds(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, rounds: int
) -> dict[str, list[float]]:
    """This rank's ring-forward compute (no transfers) under the contiguous and the zigzag
    split, ``rounds`` interleaved rounds after 2 of warm-up, each call between barriers: a
    round lasts as long as its slowest rank, as a real ring step does. ``q, k, v``: this
    rank's shard (b, h, s/cp, d)."""
    import torch.distributed as dist

    rank, cp = dist.get_rank(), dist.get_world_size()

    def one(scheme: str) -> Callable[[], object]:
        return lambda: _compute_only(q, k, v, cp, rank, causal, scheme)

    schemes = {sch: one(sch) for sch in ("contiguous", "zigzag")}
    return interleaved_times(schemes, rounds, warmup=2, sync=dist.barrier)


def ring_measurements(
    b: int,
    h: int,
    s: int,
    d: int,
    causal: bool = True,
    steps: int = 7,
    seed: int = 0,
    scheme_steps: int | None = None,
) -> dict[str, Any]:
    """On every rank of WORLD (cp = world size): this rank's saved bytes, bytes per step,
    forward seconds (medians) of the four overlap contenders, per-scheme compute seconds, and
    one traced forward + backward (events relative to a common barrier).

    The schemes (contiguous and zigzag) run ``scheme_steps`` interleaved rounds (default
    ``steps``), each call between barriers, so a round's time on any rank is the time of
    the slowest rank, as in a real ring step: ``scheme_rounds`` holds them, paired round by
    round for :func:`labkit.measure.bench_cells.verdict`, ``scheme_seconds`` their medians."""
    import torch.distributed as dist

    rank, cp = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(b, h, s, d, generator=g) for _ in range(3)]
    q, k, v = (shard_sequence(t, cp, rank).requires_grad_() for t in full)
    saved = saved_bytes(lambda: ring_attention(q, k, v, causal=causal))
    qd, kd, vd = (t.detach() for t in (q, k, v))
    kv = torch.stack([kd, vd])
    barrier = dist.barrier
    fns: dict[str, Callable[[], object]] = {
        "overlapped": lambda: ring_attention(qd, kd, vd, causal=causal),
        "serial": lambda: ring_attention(qd, kd, vd, causal=causal, overlap=False),
        "comm only": lambda: _comm_only(kv, None),
        "compute only": lambda: _compute_only(qd, kd, vd, cp, rank, causal, "zigzag"),
    }
    times = interleaved_times(fns, steps, warmup=2, sync=barrier)
    med = {n: statistics.median(ts) for n, ts in times.items()}
    rounds = split_rounds(qd, kd, vd, causal, scheme_steps or steps)
    per_scheme = {n: statistics.median(ts) for n, ts in rounds.items()}
    traced = RingStats()
    qt, kt, vt = (t.detach().clone().requires_grad_() for t in (q, k, v))
    barrier()
    t0 = time.perf_counter()
    ring_attention(qt, kt, vt, causal=causal, stats=traced).sum().backward()
    events = [(ph, st, what, at - t0) for ph, st, what, at in traced.events]
    return {
        "saved": saved,
        "sent": traced.sent,  # forward and backward steps
        "tiles": traced.tiles,
        "seconds": med,
        "scheme_seconds": per_scheme,
        "scheme_rounds": rounds,
        "events": events,
    }


def full_attention_saved(b: int, h: int, s: int, d: int, causal: bool = True) -> dict[str, int]:
    """One process: saved bytes of naive attention and of torch's fused SDPA kernel."""
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    return {
        "naive": saved_bytes(lambda: naive_attention(q, k, v, causal)),
        "sdpa": saved_bytes(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)),
    }


def overlap_fraction(seconds: dict[str, float]) -> float:
    """``(comm + compute - overlapped) / min(comm, compute)``, clipped to [0, 1]. On CPU
    ranks gloo's transfer threads share the cores with the compute, so this is a lower
    bound of what the same schedule hides where copy engines and NICs move the bytes."""
    comm, comp = seconds["comm only"], seconds["compute only"]
    hidden = (comm + comp - seconds["overlapped"]) / max(min(comm, comp), 1e-12)
    return min(max(hidden, 0.0), 1.0)
