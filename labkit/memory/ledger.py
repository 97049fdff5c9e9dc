"""What the memory tracker counts in: its categories, its snapshot, and a tensor's storages.

Split from ``tracker.py`` (the dispatch mode that does the counting, which re-exports
``CATEGORIES`` and :class:`MemoryLedger`): this is the vocabulary, with no bookkeeping.

Categories follow the ZeRO paper's ledger: ``parameters``, ``gradients``,
``optimizer_state`` (registered by the caller), ``activations`` (the default for anything
new) and ``temporaries`` (optimizer scratch and communication buffers; allocate them under
``with mt.category("temporaries"):``).

A tensor's bytes live in its untyped storages (:func:`storages`): one for a plain tensor,
shared by its views; a wrapper subclass's inner tensors for DTensor and FSDP2's parameters;
none for meta and fake tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["CATEGORIES", "MemoryLedger", "check_category", "storages"]

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")


@dataclass
class MemoryLedger:
    """A snapshot: totals plus per-category current and peak bytes."""

    current_bytes: int
    peak_bytes: int
    current: dict[str, int] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)  # each category's own maximum
    at_peak: dict[str, int] = field(default_factory=dict)  # breakdown when the total peaked


def storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages that really hold ``t``'s bytes. A wrapper subclass (DTensor, FSDP2's
    parameters) is an empty shell sized from the *global* shape: count its inner (local)
    tensors instead, recursively. Meta and fake tensors hold no bytes."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
        inner = [getattr(t, name) for name in names]
        return [st for i in inner if isinstance(i, torch.Tensor) for st in storages(i)]
    if not isinstance(t, torch.Tensor) or t.device.type == "meta" or isinstance(t, FakeTensor):
        return []
    return [t.untyped_storage()]


def check_category(name: str) -> None:
    if name not in CATEGORIES:
        raise ValueError(f"unknown memory category {name!r}; expected one of {CATEGORIES}")
