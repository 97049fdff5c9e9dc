"""A live-tensor memory ledger: bytes by category, current and peak, for tensors made by aten ops.

CPU PyTorch keeps no allocator statistics and process RSS is mostly library code, so we
count tensors ourselves. :class:`MemoryTracker` is a ``TorchDispatchMode``: every aten op
that runs inside it hands us its outputs, and for each output *storage* we have not seen
we add ``storage.nbytes()`` to the ledger and attach a ``weakref.finalize`` that subtracts it
again when the storage dies. Invariants:

* each untyped storage is counted exactly once (views, in-place ops and ``.grad`` aliases
  share a storage and add nothing);
* a wrapper tensor subclass (DTensor, FSDP2's sharded parameters) counts at its *local*
  size: its outer shell is sized from the global shape but holds no bytes, so the tracker
  lets the subclass run first (its ops come back as plain ops on local tensors) and
  ``register`` counts it by its inner tensors (``__tensor_flatten__``);
* ``current_bytes`` is the sum over live tracked storages, ``peak_bytes`` its running max;
* ``UntypedStorage.resize_`` (how FSDP frees) is followed while the tracker is active;
* each storage sits in exactly one category; ``register`` moves it (or starts tracking a
  tensor that was allocated before the tracker started, e.g. the model's parameters).

Cross-checked against PyTorch's ``torch.distributed._tools.mem_tracker.MemTracker``: the
same peak to the byte on one training step of a plain MLP and of its FSDP2 (``fully_shard``)
version on 2 gloo ranks (``tests/test_memory_tracker.py`` allows 1%).

What it does not see (so its numbers are a lower bound, not "exact"):

* tensors allocated on other threads: the dispatch mode is thread-local, so gloo's own
  threads, a background communication thread (labkit's ring in ``OverlappedDDP``), data
  loader workers and autograd's device threads are invisible unless their tensors are later
  ``register``-ed;
* memory that no aten op returns: the collectives' internal staging buffers, allocator
  rounding and fragmentation, code under ``no_dispatch``, ``torch.from_numpy`` and other
  tensors that wrap foreign memory;
* tensors created before the tracker started, unless ``register``-ed;
* nested with another tracking dispatch mode, the count depends on the nesting order (inside
  PyTorch's ``MemTracker`` it agreed to the byte, outside it over-counted FSDP2 by 27%): use
  one tracker at a time.

The categories, the snapshot and a tensor's storages are in ``ledger.py``. On CUDA,
:class:`CudaMemoryTracker` keeps the same categories but reads the totals from the caching
allocator (``torch.cuda.memory_allocated`` / ``max_memory_allocated``), which also sees
allocations made outside Python (NCCL, cuBLAS workspaces).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._guards import active_fake_mode
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
from torch.utils._pytree import tree_flatten

from labkit.memory.ledger import CATEGORIES, MemoryLedger, check_category, storages

__all__ = ["CATEGORIES", "MemoryLedger", "MemoryTracker", "CudaMemoryTracker", "tracker_for"]


class MemoryTracker(TorchDispatchMode):
    """Count live tensor bytes per category. Use as ``with MemoryTracker() as mt: ...``.

    >>> with MemoryTracker() as mt:
    ...     x = torch.empty(1000)          # 4000 bytes, category "activations"
    ...     del x                          # freed: current back to 0
    >>> mt.peak_bytes
    4000
    """

    def __init__(self, default_category: str = "activations") -> None:
        super().__init__()
        check_category(default_category)
        self._lock = threading.RLock()
        self._live: dict[int, tuple[int, str]] = {}  # id(storage) -> (nbytes, category)
        self._default = default_category
        self._current = dict.fromkeys(CATEGORIES, 0)
        self._peak = dict.fromkeys(CATEGORIES, 0)
        self._at_peak = dict.fromkeys(CATEGORIES, 0)
        self._total = 0
        self._total_peak = 0
        self._fake_mode: Any = None  # the fake mode active on entry (None in eager code)

    # ------------------------------------------------------------------ bookkeeping
    def _add(self, storage: torch.UntypedStorage, category: str) -> None:
        key = id(storage)
        with self._lock:
            old = self._live.get(key)
            if old is not None:
                if old[1] == category:
                    return
                self._move(key, old, category)
                return
            nbytes = storage.nbytes()
            self._live[key] = (nbytes, category)
            # The finalizer runs when the storage's PyObject dies, which PyTorch delays
            # until the last tensor or view of it is gone (PyObject preservation).
            weakref.finalize(storage, self._free, key)
            self._bump(category, nbytes)

    def _move(self, key: int, old: tuple[int, str], category: str) -> None:
        nbytes, was = old
        self._live[key] = (nbytes, category)
        self._current[was] -= nbytes
        self._total -= nbytes
        self._bump(category, nbytes)

    def _bump(self, category: str, nbytes: int) -> None:
        self._current[category] += nbytes
        self._total += nbytes
        self._peak[category] = max(self._peak[category], self._current[category])
        if self._total > self._total_peak:
            self._total_peak = self._total
            self._at_peak = dict(self._current)

    def _free(self, key: int) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is not None:
                self._current[entry[1]] -= entry[0]
                self._total -= entry[0]

    def _resized(self, storage: torch.UntypedStorage) -> None:
        """``storage.resize_`` bypasses the dispatcher (FSDP frees and refills its unsharded
        parameters that way): re-read the storage's size."""
        key = id(storage)
        with self._lock:
            old = self._live.get(key)
            if old is None:
                if storage.nbytes():
                    self._add(storage, self._default)
                return
            nbytes, cat = old
            self._live[key] = (storage.nbytes(), cat)
            self._current[cat] -= nbytes
            self._total -= nbytes
            self._bump(cat, storage.nbytes())

    def __enter__(self) -> MemoryTracker:
        orig = self._orig_resize = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = orig(storage, size)
            self._resized(storage)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        self._fake_mode = active_fake_mode()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            # A wrapper subclass (DTensor) first: its __torch_dispatch__ runs the op on its
            # local tensors, and those plain ops come back here to be counted at local size.
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if active_fake_mode() is not self._fake_mode:
            return out  # shape propagation on fake tensors (DTensor's) allocates nothing
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                for st in storages(t):
                    if id(st) not in self._live:
                        self._add(st, self._default)
        return out

    # ------------------------------------------------------------------ public API
    def register(
        self, tensors: torch.Tensor | Iterable[torch.Tensor | None], category: str
    ) -> None:
        """Put the storages of ``tensors`` in ``category`` (tracking them if they are new)."""
        check_category(category)
        items = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        for t in items:
            for st in [] if t is None else storages(t):
                self._add(st, category)

    def track_module(self, module: torch.nn.Module) -> None:
        """Register ``module``'s parameters, and file each ``.grad`` under gradients as
        soon as autograd accumulates it (a post-accumulate-grad hook)."""
        params = [p for p in module.parameters()]
        self.register(params, "parameters")
        for p in params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(
                    lambda q: self.register(q.grad, "gradients") if q.grad is not None else None
                )

    @contextmanager
    def category(self, name: str) -> Iterator[None]:
        """New allocations inside this block default to category ``name``."""
        check_category(name)
        before, self._default = self._default, name
        try:
            yield
        finally:
            self._default = before

    def settle(self, timeout: float = 1.0, quiet_polls: int = 5, poll: float = 0.01) -> None:
        """Wait (at most ``timeout`` seconds) until the live bytes stop changing.

        gloo's worker threads drop their reference to a finished collective's tensors a moment
        after the caller has returned (longer on a loaded machine), and a reference cycle holds
        a storage until the collector runs. Read or reset the ledger after ``settle()``, not
        right after communication: a real leak stays and is still counted.
        """
        import gc
        import time

        gc.collect()
        deadline = time.monotonic() + timeout
        last, same = self.current_by_category(), 0
        while same < quiet_polls and time.monotonic() < deadline:
            time.sleep(poll)
            now = self.current_by_category()
            same = same + 1 if now == last else 0
            last = now

    def reset_peak(self) -> None:
        """Restart the peaks from the current values (e.g. after building the model)."""
        with self._lock:
            self._peak = dict(self._current)
            self._total_peak = self._total
            self._at_peak = dict(self._current)

    @property
    def current_bytes(self) -> int:
        return self._total

    @property
    def peak_bytes(self) -> int:
        return self._total_peak

    def current_by_category(self) -> dict[str, int]:
        return dict(self._current)

    def peak_by_category(self) -> dict[str, int]:
        return dict(self._peak)

    def ledger(self) -> MemoryLedger:
        with self._lock:
            return MemoryLedger(
                self.current_bytes,
                self.peak_bytes,
                dict(self._current),
                dict(self._peak),
                dict(self._at_peak),
            )


class CudaMemoryTracker(MemoryTracker):
    """Same categories, totals from the CUDA caching allocator (relative to entry).

    ``current_bytes``/``peak_bytes`` include what the dispatch mode cannot see (NCCL and
    library workspaces); the categories still come from the live-storage ledger.
    """

    def __init__(
        self, device: torch.device | int | None = None, default_category: str = "activations"
    ):
        super().__init__(default_category)
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if device is None
            else torch.device(device)
        )
        self._base = 0

    def __enter__(self) -> CudaMemoryTracker:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._base = torch.cuda.memory_allocated(self.device)
        super().__enter__()
        return self

    def reset_peak(self) -> None:
        super().reset_peak()
        torch.cuda.reset_peak_memory_stats(self.device)

    @property
    def current_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device) - self._base

    @property
    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) - self._base


def tracker_for(device: torch.device, default_category: str = "activations") -> MemoryTracker:
    """The right tracker for ``device``: allocator statistics on CUDA, live storages elsewhere."""
    if device.type == "cuda":
        return CudaMemoryTracker(device, default_category)
    return MemoryTracker(default_category)
