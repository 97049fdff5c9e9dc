"""Bucketed DDP: gradients grouped into buckets of about ``bucket_cap_mb``, in reverse order of use.

Why buckets: one flat buffer cannot be sent before backward has produced the *last*
gradient. Cut it into buckets of a few MB and each bucket can travel as soon as *its*
gradients exist (that is :mod:`labkit.ddp.overlapped`); a bucket is still big enough that the
per-collective latency ``alpha`` is amortised (the 25 MB default of torch DDP, 1 MB here for
small models).

Why reverse order: backward visits layers last-to-first, so the first gradients to be
ready are those of the parameters used *last* in forward. Registration order approximates
forward order, so buckets are filled from the end of ``module.parameters()``. (torch DDP
also records the real ready-order during the first iteration and rebuilds its buckets.)

This module does the grouping and sends buckets one after another *after* backward: the
same traffic as :mod:`labkit.ddp.flat` in more messages, so on its own it is no faster.
It is the stepping stone: the sweep in notebook 03 shows the latency/size trade-off.
"""

from __future__ import annotations

from torch import nn
from torch.distributed import ProcessGroup

from labkit.collectives.comm import Comm
from labkit.ddp.base import DataParallel
from labkit.ddp.compression import Compression


def partition_buckets(sizes_bytes: list[int], cap_bytes: int) -> list[list[int]]:
    """Greedy split of ``sizes_bytes`` (already in send order) into consecutive buckets.

    A bucket is closed as soon as it holds at least ``cap_bytes``; a parameter larger than
    the cap gets a bucket of its own. Returns indices into ``sizes_bytes``; every index
    appears exactly once and order is preserved.

    >>> partition_buckets([4, 4, 4, 10, 1], cap_bytes=8)
    [[0, 1], [2, 3], [4]]
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i, size in enumerate(sizes_bytes):
        current.append(i)
        filled += size
        if filled >= cap_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


def bucket_cap_bytes(bucket_cap_mb: float) -> int:
    """The cap in bytes; a non-positive cap is refused before any process communicates."""
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
    return max(1, int(bucket_cap_mb * 2**20))


def make_buckets(params: list[nn.Parameter], cap_bytes: int) -> list[list[nn.Parameter]]:
    """``params`` (in order of use in forward) cut into buckets, the last-used first."""
    order = list(reversed(params))  # backward produces these first
    sizes = [p.numel() * p.element_size() for p in order]
    return [[order[i] for i in idx] for idx in partition_buckets(sizes, cap_bytes)]


class BucketedDDP(DataParallel):
    """Buckets of ``bucket_cap_mb`` in reverse order of use, each all-reduced after backward."""

    def __init__(
        self,
        module: nn.Module,
        *,
        bucket_cap_mb: float = 1.0,
        group: ProcessGroup | None = None,
        comm: Comm | None = None,
        record_events: bool = False,
        compression: Compression | None = None,
    ):
        cap = bucket_cap_bytes(bucket_cap_mb)
        super().__init__(
            module, group=group, comm=comm, record_events=record_events, compression=compression
        )
        self.bucket_cap_mb = bucket_cap_mb
        self.buckets = make_buckets(self.params, cap)

    def finish_gradient_sync(self) -> None:
        """Average the gradients over the group; call after the last backward, before step()."""
        if not self.require_sync:
            return
        self.elements_reduced = 0
        for k, bucket in enumerate(self.buckets):
            buf = self.pack(bucket)  # (sum numel + len(bucket),)
            self.all_reduce(buf, f"bucket {k}")
            self.unpack(buf, bucket)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, buckets={len(self.buckets)}, cap={self.bucket_cap_mb} MB"
