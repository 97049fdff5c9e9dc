"""MNIST loader (shipped, corrupt, truncated, missing files) and the sampler's invariants."""

from __future__ import annotations

import gzip
import struct
from collections import Counter

import numpy as np
import pytest
import torch

from labkit.data import shipped
from labkit.data.mnist import MNIST, IdxError, load_pair, read_idx
from labkit.data.sampler import DistributedSampler, make_loader, shard_indices

IMAGES = shipped("mnist/t10k-images-idx3-ubyte.gz")
LABELS = shipped("mnist/t10k-labels-idx1-ubyte.gz")


def write_idx(path, array: np.ndarray, magic_type: int = 0x08, gz: bool = False) -> None:
    header = struct.pack(">HBB", 0, magic_type, array.ndim) + struct.pack(
        f">{array.ndim}i", *array.shape
    )
    data = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if gz else data)


# ---- the shipped files --------------------------------------------------------------


def test_shipped_test_split_reads_as_real_mnist():
    images, labels = load_pair(IMAGES, LABELS)
    assert images.shape == (10000, 28, 28) and images.dtype == torch.uint8
    assert labels.shape == (10000,) and labels.dtype == torch.int64
    counts = Counter(labels.tolist())
    # every digit, ~1000 each
    assert sorted(counts) == list(range(10)) and min(counts.values()) > 850
    assert labels[:10].tolist() == [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]  # the famous first test digits
    assert 0.12 < images.float().mean().item() / 255 < 0.14  # MNIST's mean ink


def test_offline_split_is_fixed_disjoint_and_normalised():
    train, val = MNIST("train"), MNIST("val")
    assert (len(train), len(val)) == (8000, 2000)
    images, labels = load_pair(IMAGES, LABELS)
    assert torch.equal(val.labels, labels[8000:]) and torch.equal(train.labels, labels[:8000])
    x, y = train[0]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and int(y) == 7
    assert abs(train.images.mean().item()) < 0.1 and 0.9 < train.images.std().item() < 1.1
    assert len(MNIST("val", limit=5)) == 5
    with pytest.raises(ValueError, match="split must be 'train' or 'val', got 'test'"):
        MNIST("test")


def test_full_dataset_from_a_user_folder(tmp_path):
    rng = np.random.default_rng(0)
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", rng.integers(0, 256, (6, 28, 28)), gz=True)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.arange(6), gz=True)
    # raw works too
    write_idx(tmp_path / "t10k-images-idx3-ubyte", rng.integers(0, 256, (4, 28, 28)))
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.arange(4))
    assert len(MNIST("train", root=tmp_path)) == 6
    assert MNIST("val", root=tmp_path).labels.tolist() == [0, 1, 2, 3]


# ---- broken files: a clear error naming the file ----------------------------------------


def test_missing_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope-idx3-ubyte"):
        read_idx(tmp_path / "nope-idx3-ubyte")
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        MNIST("train", root=tmp_path)


def test_truncated_gzip_names_the_file(tmp_path):
    bad = tmp_path / "cut-images.gz"
    bad.write_bytes(IMAGES.read_bytes()[:5000])
    with pytest.raises(IdxError, match="cut-images.gz"):
        read_idx(bad)


def test_truncated_data_and_header(tmp_path):
    path = tmp_path / "short-idx3"
    write_idx(path, np.zeros((3, 28, 28)))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(IdxError, match=r"short-idx3: .*implies .*truncated"):
        read_idx(path)
    path.write_bytes(struct.pack(">HBB", 0, 8, 3) + b"\x00\x00")
    with pytest.raises(IdxError, match="truncated header"):
        read_idx(path)
    path.write_bytes(b"\x00")
    with pytest.raises(IdxError, match="too short"):
        read_idx(path)


def test_wrong_magic_type_and_mismatched_pair(tmp_path):
    labels = tmp_path / "labels"
    write_idx(labels, np.arange(3))
    with pytest.raises(IdxError, match="magic number 2049, expected 2051"):
        read_idx(labels, magic=2051)
    floats = tmp_path / "floats"
    write_idx(floats, np.zeros((2, 28, 28)), magic_type=0x0D)
    with pytest.raises(IdxError, match="not an unsigned-byte IDX"):
        read_idx(floats)
    images = tmp_path / "images"
    write_idx(images, np.zeros((4, 28, 28)))
    with pytest.raises(IdxError, match=r"\(3,\) labels for 4 images"):
        load_pair(images, labels)
    write_idx(labels, np.array([1, 2, 12, 3]))
    with pytest.raises(IdxError, match="label 12 outside 0-9"):
        load_pair(images, labels)
    garbage = tmp_path / "garbage.gz"
    garbage.write_bytes(b"\x1f\x8b" + b"not gzip at all" * 10)
    with pytest.raises(IdxError, match="garbage.gz: not a readable gzip"):
        read_idx(garbage)


# ---- the sampler ----------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 7, 10, 12, 101])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shards_partition_the_epoch(n, world_size):
    for drop_last in (False, True):
        shards = [
            shard_indices(n, r, world_size, epoch=3, drop_last=drop_last) for r in range(world_size)
        ]
        lengths = {len(s) for s in shards}
        assert len(lengths) == 1, "every rank must take the same number of steps"
        samplers = [
            DistributedSampler(n, r, world_size, drop_last=drop_last) for r in range(world_size)
        ]
        for s in samplers:
            s.set_epoch(3)
        assert [list(s) for s in samplers] == shards and len(samplers[0]) == lengths.pop()
        flat = [i for s in shards for i in s]
        assert all(0 <= i < n for i in flat)
        if drop_last:  # disjoint, n mod W dropped, no repeats
            assert len(flat) == len(set(flat)) == (n // world_size) * world_size
        elif n > 0:  # everything seen, padded to a multiple of W by repeating
            assert set(flat) == set(range(n))
            assert len(flat) == -(-n // world_size) * world_size
            if n >= world_size:
                assert max(Counter(flat).values()) <= 2


def test_shuffle_is_identical_across_ranks_and_changes_per_epoch():
    def epoch_order(epoch: int, seed: int = 0) -> list[int]:
        shards = [shard_indices(100, r, 4, epoch=epoch, seed=seed) for r in range(4)]
        return [shards[i % 4][i // 4] for i in range(100)]  # re-interleave the global order

    e0 = epoch_order(0)
    assert e0 == epoch_order(0) and sorted(e0) == list(range(100)) and e0 != list(range(100))
    assert e0 != epoch_order(1) and e0 != epoch_order(0, seed=1)
    assert shard_indices(10, 1, 2, shuffle=False) == [1, 3, 5, 7, 9]
    assert shard_indices(5, 1, 2, shuffle=False) == [1, 3, 0]  # padded with index 0
    assert shard_indices(5, 1, 2, shuffle=False, drop_last=True) == [1, 3]


def test_sampler_rejects_bad_rank_before_use():
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        DistributedSampler(10, rank=2, world_size=2)
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        shard_indices(10, 0, 0)


def test_loader_batches_follow_the_sampler_with_and_without_workers():
    data = MNIST("val", limit=50)
    sampler = DistributedSampler(len(data), rank=1, world_size=2, seed=5)
    expected = list(sampler)
    for workers in (0, 1):
        loader = make_loader(data, 8, sampler, num_workers=workers)
        assert not loader.pin_memory  # no CUDA here: nothing to pin for
        labels = torch.cat([y for _, y in loader])
        assert labels.tolist() == data.labels[expected].tolist()
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        make_loader(data, 0)
