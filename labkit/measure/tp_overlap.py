"""What overlapped tensor parallelism hides: exposed communication, a profiler trace, a timeline.

Run inside the ranks of a tp group (``labkit.launch``). One "layer" is the SP MLP's two linears:
column-parallel d -> o (its input all-gathered), ReLU, row-parallel o -> d (its output
reduce-scattered), forward and backward on a (B, T/t, d) shard; 4 collectives of B T d values.

* :func:`measure_overlap`: four contenders interleaved (:func:`labkit.measure.timing.
  interleaved_times`, a barrier around each call): the plain SP layer, the overlapped one
  (:mod:`labkit.tensor_parallel.overlap`), the same GEMMs with no communication ("compute
  only") and the four SP collectives alone ("comm only"). Exposed communication = a layer's
  median minus compute only's; ``overlap`` = :func:`labkit.measure.context_parallel.
  overlap_fraction` (1: the shorter of comm and compute hidden entirely, 0: nothing).
* :func:`profile_layer`: ``torch.profiler`` over one forward and backward of each layer; the
  intervals of its communication (``gloo:*`` events: a message from post to completion) and of
  its GEMMs (``aten::mm``/``aten::addmm``), and how long communication was in flight while a
  GEMM ran (the union of one intersected with the union of the other). ``path``: also writes
  the Chrome trace (open it in https://ui.perfetto.dev).
* :func:`layer_outputs`: output and gradients of either layer after 2 accumulated backward
  passes, to compare bit for bit. :func:`lesson`: everything notebook 18 shows, one launch.
* :func:`layer_timeline`: the overlapped layer's :class:`~labkit.tensor_parallel.overlap_ring.
  Timeline` (post, compute, computed, waited per ring step), seconds from the first event.

On CPU ranks gloo moves bytes with its own threads on the same cores as the GEMMs (2 cores
here, shared by every rank): a transfer "in flight" under a GEMM competes with it for a core,
so the overlap measured here is a lower bound of the same schedule where DMA engines and NICs
move the bytes, and the decomposed layer also pays t - 1 step latencies and copies.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from labkit.collectives import Comm
from labkit.measure.context_parallel import overlap_fraction
from labkit.measure.timing import interleaved_times
from labkit.profiling.breakdown import export_trace
from labkit.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from labkit.tensor_parallel.mappings import all_gather_seq, reduce_scatter_seq
from labkit.tensor_parallel.overlap import OverlappedColumnLinear, OverlappedRowLinear
from labkit.tensor_parallel.overlap_ring import Timeline

__all__ = [
    "Shape",
    "contenders",
    "layer_outputs",
    "layer_timeline",
    "lesson",
    "measure_overlap",
    "profile_layer",
]

Shape = tuple[int, int, int, int]  # (B, T, d, o): batch, full sequence, hidden, MLP width
COMM_PREFIX = "gloo:"
GEMMS = ("aten::mm", "aten::addmm")


def _layer(col: nn.Module, row: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        row(torch.relu(col(x))).sum().backward()

    return run


def contenders(
    shape: Shape, impl: str = "torch", timeline: Timeline | None = None
) -> dict[str, Callable[[], None]]:
    """The four contenders of :func:`measure_overlap` on this rank (same weights everywhere)."""
    B, T, d, o = shape
    r, t = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(d, o), nn.Linear(o, d)
    comm = Comm(None, impl)
    x = torch.randn(B, T // t, d, requires_grad=True)  # (B, T/t, d): this rank's tokens
    plain = _layer(
        ColumnParallelLinear(lin1, comm, "gather"),
        RowParallelLinear(lin2, comm, "reduce_scatter"),
        x,
    )
    ovl = _layer(
        OverlappedColumnLinear(lin1, comm, timeline), OverlappedRowLinear(lin2, comm, timeline), x
    )
    w1 = lin1.weight.detach()[r * o // t : (r + 1) * o // t].clone().requires_grad_()  # (o/t, d)
    w2 = lin2.weight.detach()[:, r * o // t : (r + 1) * o // t].clone().requires_grad_()  # (d, o/t)
    xf = torch.randn(B, T, d, requires_grad=True)  # (B, T, d): what the gather would give

    def compute_only() -> None:  # the same GEMMs on the same sizes, nothing sent
        F.linear(torch.relu(F.linear(xf, w1)), w2).sum().backward()

    shard, full = torch.randn(B, T // t, d), torch.randn(B, T, d)

    def comm_only() -> None:  # the 4 SP collectives: AG + RS forward, RS + AG backward
        all_gather_seq(shard, comm), reduce_scatter_seq(full, comm)
        reduce_scatter_seq(full, comm), all_gather_seq(shard, comm)

    return {"plain": plain, "overlapped": ovl, "compute only": compute_only, "comm only": comm_only}


def measure_overlap(
    shape: Shape = (4, 256, 256, 1024), steps: int = 10, impl: str = "torch"
) -> dict[str, Any]:
    """Per-call seconds of the four contenders (lists), their medians, the exposed
    communication of the plain and the overlapped layer, and the overlap fraction."""
    fns = contenders(shape, impl)
    times = interleaved_times(fns, steps, warmup=2, sync=dist.barrier)
    median = {k: statistics.median(v) for k, v in times.items()}
    exposed = {k: median[k] - median["compute only"] for k in ("plain", "overlapped")}
    return {
        "times": times,
        "median": median,
        "exposed": exposed,
        "overlap": overlap_fraction(median),
        "shape": shape,
    }


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _overlap_s(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def profile_layer(
    shape: Shape = (4, 256, 256, 1024), impl: str = "torch", path: str | None = None
) -> dict[str, Any]:
    """Intervals (seconds from the layer's start) of communication and GEMMs in one forward and
    backward of each layer, and the seconds communication was in flight under a GEMM."""
    from torch.profiler import ProfilerActivity, profile

    fns = contenders(shape, impl)
    out: dict[str, Any] = {}
    for name in ("plain", "overlapped"):
        fns[name]()  # warm: the size check's one exchange is cached after this
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fns[name]()
        if path is not None:
            export_trace(prof, f"{path}.{name}.rank{dist.get_rank()}.json")  # no link followed
        events = list(prof.events())
        t0 = min(e.time_range.start for e in events)
        spans = {"comm": [], "gemm": []}  # type: dict[str, list[tuple[float, float]]]
        for e in events:
            kind = "comm" if e.name.startswith(COMM_PREFIX) else "gemm" if e.name in GEMMS else None
            if kind is not None:
                spans[kind].append(((e.time_range.start - t0) / 1e6, (e.time_range.end - t0) / 1e6))
        comm, gemm = _union(spans["comm"]), _union(spans["gemm"])
        out[name] = {
            "comm": comm, "gemm": gemm, "comm_s": sum(e - s for s, e in comm),
            "gemm_s": sum(e - s for s, e in gemm), "under_gemm_s": _overlap_s(comm, gemm),
            "total_s": max(e.time_range.end for e in events) / 1e6 - t0 / 1e6,
        }  # fmt: skip
    return out


def layer_timeline(
    shape: Shape = (4, 256, 256, 1024), impl: str = "torch"
) -> list[tuple[str, int, str, float]]:
    """The overlapped layer's ring events of one forward and backward, seconds from the first."""
    timeline = Timeline()
    fn = contenders(shape, impl, timeline)["overlapped"]
    fn()  # warm
    timeline.events.clear()
    dist.barrier()
    fn()
    t0 = timeline.events[0][3]
    return [(phase, step, what, at - t0) for phase, step, what, at in timeline.events]


def _layers(shape: Shape, impl: str, overlapped: bool) -> tuple[nn.Module, nn.Module]:
    B, T, d, o = shape
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(d, o), nn.Linear(o, d)
    comm = Comm(None, impl)
    if overlapped:
        return OverlappedColumnLinear(lin1, comm), OverlappedRowLinear(lin2, comm)
    return ColumnParallelLinear(lin1, comm, "gather"), RowParallelLinear(
        lin2, comm, "reduce_scatter"
    )


def layer_outputs(shape: Shape, impl: str, overlapped: bool) -> list[torch.Tensor]:
    """Output, input gradient and every parameter gradient of column -> ReLU -> row on this
    rank's tokens of one fixed batch, after 2 backward passes accumulated into ``.grad``."""
    B, T, d, o = shape
    r, t = dist.get_rank(), dist.get_world_size()
    col, row = _layers(shape, impl, overlapped)
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(B, T, d, generator=g), torch.randn(B, T, d, generator=g)
    n = T // t
    xs = x[:, r * n : (r + 1) * n].clone().requires_grad_()  # (B, T/t, d): this rank's tokens
    y = xs
    for _ in range(2):  # accumulation: the second backward adds to .grad
        y = row(torch.relu(col(xs)))
        y.backward(dy[:, r * n : (r + 1) * n])
    grads = [p.grad for p in (*col.parameters(), *row.parameters())]
    return [y.detach(), xs.grad, *grads]  # type: ignore[list-item]


def lesson(shape: Shape = (4, 256, 256, 1024), steps: int = 6) -> dict[str, Any]:
    """Notebook 18's run on one rank: bit-equality with the plain layer (labkit's ring,
    a (2, 16, 32, 48) layer), the timeline, the profile and the interleaved times."""
    small = (2, 16, 32, 48)
    pairs = zip(layer_outputs(small, "ring", False), layer_outputs(small, "ring", True))
    return {
        "equal": [torch.equal(a, b) for a, b in pairs],
        "timeline": layer_timeline(shape),
        "profile": profile_layer(shape),
        "overlap": measure_overlap(shape, steps),
    }
