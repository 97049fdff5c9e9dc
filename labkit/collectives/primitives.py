"""The bricks every from-scratch collective is built of: ops, dtypes, chunks, batched messages.

Split from ``common.py`` (which re-exports all of it, next to the one argument check), so that
each of the two reads as one job.

* **Ops.** SUM, AVG, MAX and MIN (:func:`combine_`). AVG is a SUM divided by the group size
  at the very end, in the accumulation dtype, so it costs one rounding like the native AVG.
* **Precision.** float16/bfloat16 are reduced in float32 (:func:`accum_dtype`): partial
  results travel and are added in float32, and the result is rounded to the input dtype once.
  float32/float64 are reduced in their own dtype.
* **Wire.** ``wire="accum"`` (the default, above) or ``wire="input"``: 16-bit partials
  travel in their own dtype, each hop adds in float32 and rounds back (as NCCL does), half
  the bytes of the reduce phase (:func:`wire_dtype`; the bounds are in ``ring_tuned.py``).
* **Chunks.** ``n`` elements over ``p`` ranks split like ``torch.tensor_split``: the first
  ``n % p`` chunks hold one extra element. A chunk may be empty (``n < p``); empty chunks are
  never sent, and both ends of a link know that because every rank agrees on ``n``.
* **Messages.** :func:`post` puts one step's sends and receives in ONE
  ``dist.batch_isend_irecv``, the order that cannot deadlock under NCCL (see its docstring);
  ``tests/test_collectives.py`` records every point-to-point call to prove it. Every message
  names the collective's group, so two threads on two groups never match each other's
  messages (gloo pairs point-to-point messages per group, by peer and tag).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

__all__ = [
    "CONTROL_TAG",
    "SUPPORTED_OPS",
    "SUPPORTED_DTYPES",
    "WIRES",
    "accum_dtype",
    "chunk_sizes",
    "chunk_offsets",
    "combine_",
    "exchange",
    "op_name",
    "post",
    "wire_dtype",
]

CONTROL_TAG = 0x1AB  # labkit's control messages: argument checks, settles (never data)
SUPPORTED_OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN)
SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def op_name(op: object) -> str:
    """A readable name for a ReduceOp (they print as opaque objects)."""
    for name in ("SUM", "AVG", "MAX", "MIN", "PRODUCT", "BAND", "BOR", "BXOR", "PREMUL_SUM"):
        if op == getattr(ReduceOp, name, None):
            return name
    return repr(op)


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results are added in: float32 for 16-bit floats, else the dtype itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


WIRES = ("accum", "input")  # what 16-bit partials travel as: float32, or their own dtype


def wire_dtype(dtype: torch.dtype, wire: str = "accum") -> torch.dtype:
    """The dtype partials travel and are added in: :func:`accum_dtype` for ``wire="accum"``,
    the input dtype itself for ``wire="input"`` (each hop then rounds to it)."""
    if wire not in WIRES:
        raise ValueError(f"wire must be one of {WIRES}, got {wire!r}")
    return accum_dtype(dtype) if wire == "accum" else dtype


def chunk_sizes(n: int, p: int) -> list[int]:
    """Sizes of the ``p`` chunks of ``n`` elements: the first ``n % p`` get one extra element.

    >>> chunk_sizes(10, 4)
    [3, 3, 2, 2]
    """
    base, extra = divmod(n, p)
    return [base + (1 if c < extra else 0) for c in range(p)]


def chunk_offsets(n: int, p: int) -> list[int]:
    """Start offset of every chunk of :func:`chunk_sizes` (``p + 1`` entries, the last is ``n``)."""
    offsets = [0]
    for size in chunk_sizes(n, p):
        offsets.append(offsets[-1] + size)
    return offsets


def combine_(acc: torch.Tensor, x: torch.Tensor, op: object) -> torch.Tensor:
    """``acc = acc (op) x`` in place; ``x`` may have a lower-precision dtype than ``acc``."""
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        return acc.add_(x)
    if op == ReduceOp.MAX:
        return torch.maximum(acc, x, out=acc)
    if op == ReduceOp.MIN:
        return torch.minimum(acc, x, out=acc)
    raise ValueError(f"unsupported reduce op {op_name(op)}")


class _Joined:
    """One handle for several: NCCL coalesces a batch into a single Work for all its ops."""

    def __init__(self, works: list[dist.Work]) -> None:
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True


def post(
    sends: list[tuple[torch.Tensor, int]],
    recvs: list[tuple[torch.Tensor, int]],
    group: ProcessGroup | None,
    tag: int = 0,
) -> tuple[list[Any], list[Any]]:
    """Post one step's sends and receives (``(tensor, global peer)``) as ONE batch.

    Why a batch: NCCL runs ungrouped point-to-point calls between two ranks on one stream in
    issue order, so a rank that posts ``irecv`` then ``isend`` against a peer doing the same
    waits forever (gloo hides it). Inside ``dist.batch_isend_irecv`` the order of sends and
    receives does not matter. Empty tensors are skipped: both ends know the sizes, so both
    skip the same messages. ``tag``: :data:`CONTROL_TAG` marks labkit's control messages (the
    argument check's rows, the guard's settle) apart from data. Returns the receive handles
    and the send handles, in order (with NCCL, whose batch yields one handle, every entry
    waits for the whole batch).
    """
    # receives first: under gloo a send waits for the peer's "receive posted" notice, so
    # announcing ours early lets the peer's data start flowing sooner (NCCL does not care)
    ops = [dist.P2POp(dist.irecv, t, peer, group, tag) for t, peer in recvs if t.numel()]
    ops += [dist.P2POp(dist.isend, t, peer, group, tag) for t, peer in sends if t.numel()]
    works: list[Any] = dist.batch_isend_irecv(ops) if ops else []
    if len(works) != len(ops):
        works = [_Joined(works)] * len(ops)
    handles = iter(works)
    recv_works = [next(handles) if t.numel() else _Joined([]) for t, _ in recvs]
    send_works = [next(handles) if t.numel() else _Joined([]) for t, _ in sends]
    return recv_works, send_works


def exchange(
    send: torch.Tensor, to: int, recv: torch.Tensor, source: int, group: ProcessGroup | None
) -> None:
    """Send ``send`` to global rank ``to`` while receiving ``recv`` from ``source``; wait."""
    recv_works, send_works = post([(send, to)], [(recv, source)], group)
    for work in recv_works + send_works:
        work.wait()
