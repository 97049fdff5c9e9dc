"""The one way to swap labkit's own collectives in: ``Comm(group, impl=...)``, counting bytes.

DDP, ZeRO and tensor parallelism all communicate through a :class:`Comm`, so switching every
technique from PyTorch's collectives to labkit's ring is one argument, ``impl="ring"``.

``Comm(group, impl="torch")`` uses torch.distributed (``reduce_scatter_single`` /
``all_gather_single``, the 2.13 names of ``reduce_scatter_tensor`` / ``all_gather_into_tensor``);
``impl="ring"`` uses labkit's own collectives where speed matters: the tuned ring
(:mod:`labkit.collectives.ring_tuned`) and, for all-reduce, :mod:`labkit.collectives.auto`
(recursive doubling below a measured size).

Byte accounting. ``sent[op]`` is what a bandwidth-optimal (ring) algorithm sends from this
rank for the calls made: a reduce-scatter or all-gather of ``M`` bytes sends
``(N-1)/N * M``, an all-reduce twice that. That is the quantity behind ZeRO's 2Psi / 3Psi
argument (the paper rounds ``(N-1)/N`` to 1).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["Comm", "IMPLS"]

IMPLS = ("torch", "ring")

# torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor to *_single; older releases
# (a GPU image may ship one) have only the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Done:
    def wait(self) -> None:
        return None


class Comm:
    """reduce_scatter (SUM) / all_gather / all_reduce (SUM) over ``group``, with byte counters."""

    def __init__(self, group: ProcessGroup | None = None, impl: str = "torch") -> None:
        if impl not in IMPLS:
            raise ValueError(f"unknown collective implementation {impl!r}; expected one of {IMPLS}")
        self.group = group
        self.impl = impl
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.sent: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def _count(self, op: str, nbytes: int, factor: int = 1) -> None:
        n = self.world_size
        self.sent[op] += factor * nbytes * (n - 1) // n
        self.calls[op] += 1

    def reset(self) -> None:
        self.sent.clear()
        self.calls.clear()

    @property
    def total_sent(self) -> int:
        return sum(self.sent.values())

    def reduce_scatter(self, out_shard: torch.Tensor, in_full: torch.Tensor) -> None:
        """``out_shard`` <- this rank's chunk of the SUM of ``in_full`` over ranks."""
        self._count("reduce_scatter", in_full.numel() * in_full.element_size())
        if self.world_size == 1:
            out_shard.copy_(in_full)
        elif self.impl == "ring":
            from labkit.collectives.ring_tuned import tuned_reduce_scatter

            tuned_reduce_scatter(out_shard, in_full, group=self.group, check=False)
        else:
            _reduce_scatter(out_shard, in_full, group=self.group)

    def all_gather(
        self, out_full: torch.Tensor, in_shard: torch.Tensor, async_op: bool = False
    ) -> Any:
        """``out_full`` <- every rank's ``in_shard`` end to end. Returns a handle to ``wait()``."""
        self._count("all_gather", out_full.numel() * out_full.element_size())
        if self.world_size == 1:
            out_full.copy_(in_shard)
        elif self.impl == "ring":  # labkit's ring is blocking: async degrades to sync
            from labkit.collectives.ring_tuned import tuned_all_gather

            tuned_all_gather(out_full, in_shard, group=self.group, check=False)
        else:
            work = _all_gather(out_full, in_shard, group=self.group, async_op=async_op)
            if async_op:
                return work
        return _Done()

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> Any:
        """``tensor`` <- SUM over ranks (the DDP baseline). Returns a handle to ``wait()``."""
        self._count("all_reduce", tensor.numel() * tensor.element_size(), factor=2)
        if self.world_size == 1:
            return _Done()
        if self.impl == "ring":  # labkit's ring is blocking: async degrades to sync
            from labkit.collectives.auto import all_reduce

            all_reduce(tensor, group=self.group, check=False)
        else:
            work = dist.all_reduce(tensor, group=self.group, async_op=async_op)
            if async_op:
                return work
        return _Done()
