"""A distributed sampler from scratch, and the DataLoader every data-parallel lab uses.

Data parallelism needs each rank to see a *different* slice of every epoch, and all ranks
together to see the whole dataset. :func:`shard_indices` is the pure rule:

1. **Same permutation everywhere.** Every rank draws ``randperm(n)`` from a generator seeded
   with ``seed + epoch``: identical on all ranks without any communication, different each
   epoch (call :meth:`DistributedSampler.set_epoch` before each epoch, as with torch's).
2. **Equal length per rank.** Collectives need every rank to run the same number of steps,
   so the permutation is cut to a multiple of ``world_size``:

   * ``drop_last=False`` (default): pad by repeating indices from the start of the
     permutation up to ``ceil(n / W) * W``; every sample is seen at least once per epoch,
     ``total - n`` of them twice (at most ``W - 1``, unless n < W);
   * ``drop_last=True``: truncate to ``floor(n / W) * W``; ``n mod W`` samples are skipped
     this epoch (different ones each epoch when shuffling) and no sample repeats.

3. **Disjoint shards.** Rank ``r`` takes positions ``r, r + W, r + 2W, ...`` of the cut
   permutation: the shards partition it, so without padding no index is on two ranks.

Like everything in labkit, ``rank`` and ``world_size`` are arguments, never read from the
environment: the same sampler serves any process group.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


def shard_indices(
    n: int,
    rank: int,
    world_size: int,
    *,
    epoch: int = 0,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
) -> list[int]:
    """The dataset indices rank ``rank`` visits in epoch ``epoch`` (see the module docstring)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if n < 0:
        raise ValueError(f"dataset length must be >= 0, got {n}")
    if shuffle:
        g = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(n, generator=g).tolist()
    else:
        order = list(range(n))
    if drop_last:
        order = order[: (n // world_size) * world_size]
    elif n > 0:
        total = math.ceil(n / world_size) * world_size
        order = (order * math.ceil(total / n))[:total]  # wrap around as often as needed
    return order[rank::world_size]


class DistributedSampler(Sampler[int]):
    """Yields :func:`shard_indices` for the current epoch; set it with :meth:`set_epoch`."""

    def __init__(
        self,
        dataset_len: int,
        rank: int,
        world_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ):
        shard_indices(0, rank, world_size)  # validates rank and world_size now, not at first use
        self.n, self.rank, self.world_size = dataset_len, rank, world_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(
            shard_indices(
                self.n,
                self.rank,
                self.world_size,
                epoch=self.epoch,
                seed=self.seed,
                shuffle=self.shuffle,
                drop_last=self.drop_last,
            )
        )

    def __len__(self) -> int:
        if self.drop_last:
            return self.n // self.world_size
        return math.ceil(self.n / self.world_size)


def make_loader(
    dataset: Dataset,
    batch_size: int,
    sampler: Sampler[int] | None = None,
    *,
    device: torch.device | None = None,
    num_workers: int | None = None,
) -> DataLoader:
    """A DataLoader with worker processes and pinned memory when the batches go to a GPU.

    On CUDA: ``num_workers=2`` processes prepare batches while the GPU computes, and pinned
    (page-locked) host memory lets ``.to(device, non_blocking=True)`` copy asynchronously.
    On a CPU, the default is ``num_workers=0``: the ranks already own every core, and a
    worker would only steal cycles from the training step (data here is in memory anyway).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    cuda = device is not None and device.type == "cuda"
    workers = (2 if cuda else 0) if num_workers is None else num_workers
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        shuffle=False if sampler is not None else None,
        num_workers=workers,
        pin_memory=cuda,
        persistent_workers=workers > 0,
        drop_last=False,
    )
