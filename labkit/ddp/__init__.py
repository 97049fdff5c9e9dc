"""Data parallelism from scratch: four variants of DDP behind one interface.

Read in this order: :mod:`~labkit.ddp.base` (the invariant and the shared pieces: wrapper,
gradient buffer, clock), :mod:`~labkit.ddp.naive`, :mod:`~labkit.ddp.flat`,
:mod:`~labkit.ddp.bucketed`, :mod:`~labkit.ddp.overlapped`; each variant reads alone.
:mod:`~labkit.ddp.equivalence` is the harness that proves each one equals single-process
training. Every variant communicates through a :class:`labkit.collectives.Comm`
(``comm=Comm(group, impl="ring")`` swaps in labkit's own ring), and any of them takes
``compression=`` (:mod:`~labkit.ddp.compression`: fp16/bf16 casting, PowerSGD).
"""

from labkit.ddp.base import DataParallel, Event
from labkit.ddp.bucketed import BucketedDDP, partition_buckets
from labkit.ddp.compression import Compression, Fp16Compression, PowerSGD
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
    "BucketedDDP",
    "Compression",
    "DataParallel",
    "Event",
    "FlatDDP",
    "Fp16Compression",
    "NaiveDDP",
    "OverlappedDDP",
    "PowerSGD",
    "partition_buckets",
]
