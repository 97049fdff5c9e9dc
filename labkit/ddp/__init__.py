"""Data parallelism from scratch: four variants of DDP behind one interface.

Read in this order: :mod:`~labkit.ddp.base` (the invariant and the shared bookkeeping),
:mod:`~labkit.ddp.naive`, :mod:`~labkit.ddp.flat`, :mod:`~labkit.ddp.bucketed`,
:mod:`~labkit.ddp.overlapped`. :mod:`~labkit.ddp.equivalence` is the harness that proves
each one equals single-process training.
"""

from labkit.ddp.base import AllReduceFn, DataParallel, Event, torch_all_reduce
from labkit.ddp.bucketed import BucketedDDP, partition_buckets
from labkit.ddp.flat import FlatDDP
from labkit.ddp.naive import NaiveDDP
from labkit.ddp.overlapped import OverlappedDDP

VARIANTS: dict[str, type[DataParallel]] = {
    "naive": NaiveDDP,
    "flat": FlatDDP,
    "bucketed": BucketedDDP,
    "overlapped": OverlappedDDP,
}

__all__ = [
    "VARIANTS",
    "AllReduceFn",
    "BucketedDDP",
    "DataParallel",
    "Event",
    "FlatDDP",
    "NaiveDDP",
    "OverlappedDDP",
    "partition_buckets",
    "torch_all_reduce",
]
