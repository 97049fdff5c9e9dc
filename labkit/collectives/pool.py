"""Scratch buffers of the from-scratch collectives: allocated once, grown, one set per thread.

Why a pool: on a CPU, a fresh 128 MB tensor costs ~57 ms of page faults on first touch, more
than gloo needs to move it, so allocating per call would dominate a collective's time.
Why per thread: see :class:`BufferPool` (the thread rule). ``common.py`` re-exports both names.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

__all__ = ["BufferPool", "DEFAULT_POOL"]


class _ThreadBuffers:
    """One thread's scratch tensors (a holder, so the pool can find and free them)."""

    __slots__ = ("buffers", "__weakref__")

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


class BufferPool:
    """Scratch tensors reused across calls, one growing allocation per (thread, slot, dtype,
    device).

    ``get(slot, numel, dtype, device)`` returns the first ``numel`` elements of a cached flat
    tensor of the calling thread. A request larger than the cache reallocates to
    ``max(numel, 2 * old)`` so a sequence of growing calls costs O(log) allocations.
    ``allocations`` counts them, over all threads (tests use it to prove reuse). A returned
    view stays valid until the same thread's next ``get`` of that slot.

    **The thread rule.** Every labkit collective may run on any thread, on different groups
    at once (DDP's communication thread all-reduces over dp while the main thread's tensor
    parallelism all-reduces over tp). Hence the buffers are *per thread*: a collective's
    scratch is live from its first ``get`` until it returns, and a thread runs one
    collective at a time (labkit's collectives block; one that calls another, as the
    hierarchical all-reduce does, uses other slots), so two live uses of one slot are always
    on two threads, and two threads never share a buffer. Per (thread, group) would add no
    safety, only memory: one thread's calls on two groups are never live at once. The cost:
    each thread that communicates keeps its own scratch (DDP's one communication thread
    doubles it); a thread's buffers are freed when the thread ends, everyone's by ``clear()``.

    ``validated`` (the combinations :func:`validate` passed) is *shared* by the threads and
    keyed by group, because whether a call exchanges must be the same decision on every rank:
    it depends only on the calls made on that group before, whichever thread made them.
    Calls on one group must be ordered, as every collective requires (the same order on
    every rank; two threads on one group at once are undefined, for torch's collectives
    too); calls on different groups may overlap freely. A lock guards the set.
    """

    def __init__(self) -> None:
        self._local = threading.local()  # .holder: this thread's _ThreadBuffers
        self._holders: weakref.WeakSet[_ThreadBuffers] = weakref.WeakSet()  # for clear()
        self._lock = threading.Lock()
        self.allocations = 0
        self.validated: set[tuple[Any, ...]] = set()  # argument combinations validate passed

    def _mine(self) -> dict[tuple[str, torch.dtype, torch.device], torch.Tensor]:
        holder = getattr(self._local, "holder", None)
        if holder is None:  # this thread's first get; the thread-local keeps it alive
            holder = self._local.holder = _ThreadBuffers()
            with self._lock:
                self._holders.add(holder)
        return holder.buffers

    def get(self, slot: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buffers = self._mine()
        key = (slot, dtype, torch.device(device))
        buf = buffers.get(key)
        if buf is None or buf.numel() < numel:
            grown = max(numel, 2 * buf.numel()) if buf is not None else numel
            buf = torch.empty(grown, dtype=dtype, device=device)
            buffers[key] = buf
            with self._lock:
                self.allocations += 1
        return buf[:numel]

    def is_validated(self, key: tuple[Any, ...]) -> bool:
        with self._lock:
            return key in self.validated

    def mark_validated(self, key: tuple[Any, ...]) -> None:
        with self._lock:
            self.validated.add(key)

    def clear(self) -> None:
        """Free every thread's scratch buffers and forget validated arguments: the next call
        redoes both. (A collective running meanwhile keeps the views it holds.)"""
        with self._lock:
            for holder in list(self._holders):
                holder.buffers.clear()
            self.validated.clear()


# One pool per process: scratch memory, like the buffers NCCL keeps per communicator, split
# by thread (the rule is in BufferPool's docstring). Every collective takes ``pool=`` to use
# another one (e.g. to free memory with ``pool.clear()``).
DEFAULT_POOL = BufferPool()
