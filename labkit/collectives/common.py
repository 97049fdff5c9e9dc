"""What every from-scratch collective shares: reduce ops, chunking, peers, scratch buffers, checks.

Kept apart so that ``naive.py``, ``ring.py`` and ``tree.py`` each read as one algorithm.

* **Ops.** SUM, AVG, MAX and MIN. AVG is a SUM divided by the group size at the very end,
  in the accumulation dtype, so it costs one rounding like the native AVG.
* **Precision.** float16/bfloat16 are reduced in float32 (:func:`accum_dtype`): partial
  results travel and are added in float32, and the result is rounded to the input dtype once.
  float32/float64 are reduced in their own dtype.
* **Chunks.** ``n`` elements over ``p`` ranks split like ``torch.tensor_split``: the first
  ``n % p`` chunks hold one extra element. A chunk may be empty (``n < p``); empty chunks are
  never sent, and both ends of a link know that because every rank agrees on ``n``.
* **Peers.** Inside a subgroup, ``dist.isend``/``irecv`` address the *global* rank, so every
  algorithm computes its neighbours through :func:`global_rank`.
* **Buffers.** :class:`BufferPool` hands out scratch tensors that are allocated once and grown
  geometrically. On a CPU, a fresh 128 MB tensor costs ~57 ms of page faults on first touch,
  more than gloo needs to move it, so per-call allocation would dominate the timing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from labkit.parallel.layout import global_rank, group_rank_and_size

__all__ = [
    "SUPPORTED_OPS",
    "SUPPORTED_DTYPES",
    "BufferPool",
    "DEFAULT_POOL",
    "accum_dtype",
    "chunk_sizes",
    "chunk_offsets",
    "combine_",
    "global_rank",
    "group_rank_and_size",
    "isend",
    "irecv",
    "local_problem",
    "op_name",
]

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




def isend(tensor: torch.Tensor, peer: int, tag: int = 0) -> dist.Work:
    """``dist.isend`` to global rank ``peer``; returns the handle to ``wait()`` on."""
    work = dist.isend(tensor, peer, tag=tag)
    assert work is not None  # None only for ranks outside the group, which never get here
    return work


def irecv(tensor: torch.Tensor, peer: int, tag: int = 0) -> dist.Work:
    """``dist.irecv`` from global rank ``peer``; returns the handle to ``wait()`` on."""
    work = dist.irecv(tensor, peer, tag=tag)
    assert work is not None
    return work


def local_problem(
    what: str,
    tensors: dict[str, torch.Tensor],
    op: object | None = None,
    expected_numel: dict[str, int] | None = None,
) -> str | None:
    """What is wrong with this rank's arguments, checkable without talking to anyone (or None)."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            return f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}"
        if not t.is_contiguous():
            return f"{what}: {name} must be contiguous (call .contiguous() first)"
    dtypes = {t.dtype for t in tensors.values()}
    devices = {t.device for t in tensors.values()}
    for name, t in tensors.items():
        if t.dtype not in SUPPORTED_DTYPES:
            names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
            return f"{what}: {name} has unsupported dtype {t.dtype} (supported: {names})"
    if len(dtypes) > 1 or len(devices) > 1:
        desc = ", ".join(f"{k}: {t.dtype} on {t.device}" for k, t in tensors.items())
        return f"{what}: tensors must share dtype and device, got {desc}"
    if op is not None and op not in SUPPORTED_OPS:
        return f"{what}: unsupported reduce op {op_name(op)} (supported: SUM, AVG, MAX, MIN)"
    for name, numel in (expected_numel or {}).items():
        if tensors[name].numel() != numel:
            return f"{what}: {name} must have {numel} elements on this rank, got {tensors[name].numel()}"
    return None


class BufferPool:
    """Scratch tensors reused across calls, one growing allocation per (slot, dtype, device).

    ``get(slot, numel, dtype, device)`` returns the first ``numel`` elements of a cached flat
    tensor. A request larger than the cache reallocates to ``max(numel, 2 * old)`` so a
    sequence of growing calls costs O(log) allocations. ``allocations`` counts them (tests
    use it to prove reuse). A returned view stays valid until the next ``get`` of that slot.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        self.allocations = 0

    def get(self, slot: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (slot, dtype, torch.device(device))
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            grown = max(numel, 2 * buf.numel()) if buf is not None else numel
            buf = torch.empty(grown, dtype=dtype, device=device)
            self._buffers[key] = buf
            self.allocations += 1
        return buf[:numel]

    def clear(self) -> None:
        """Release every scratch buffer (the next call allocates again)."""
        self._buffers.clear()


# One pool per process: scratch memory, like the buffers NCCL keeps per communicator. Every
# collective takes ``pool=`` to use another one (e.g. to free memory with ``pool.clear()``).
DEFAULT_POOL = BufferPool()
