"""MNIST from its original IDX files, read by our own 30-line parser (no torchvision).

The IDX format (LeCun et al., http://yann.lecun.com/exdb/mnist/), big-endian throughout::

    bytes 0-1   0x00 0x00
    byte  2     element type: 0x08 = unsigned byte (the only one MNIST uses)
    byte  3     number of dimensions, d (3 for images, 1 for labels)
    4 * d       each dimension as an int32: (N, 28, 28) or (N,)
    ...         N * 28 * 28 (or N) bytes of data, row-major

so the images file starts with the magic number 2051 (0x00000803) and the labels file with
2049 (0x00000801). Files may be gzipped (``.gz``) or raw.

Splits, fixed and documented:

* **offline default** (no ``root``): the 10,000-image *test* split shipped with labkit,
  cut deterministically into ``train`` = images ``[0, 8000)`` and ``val`` =
  ``[8000, 10000)``. The MNIST test set mixes writers evenly, so both halves are fair;
  8,000 digits train the small CNN to ~97% validation accuracy in seconds.
* **full data** (``root=DIR`` holding the four original files, e.g. from :func:`download`):
  ``train`` = the 60,000 training images, ``val`` = the 10,000 test images.

Normalisation: pixels ``uint8 [0, 255] -> x / 255``, then ``(x - 0.1307) / 0.3081``, the
mean and standard deviation of the 60k training pixels, so inputs are roughly zero-mean,
unit-variance (the usual MNIST constants).
"""

from __future__ import annotations

import gzip
import struct
import urllib.request
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from labkit.data import shipped
from labkit.safe_files import make_private_dir, write_private

MEAN, STD = 0.1307, 0.3081
OFFLINE_TRAIN = 8000  # offline split: first 8,000 shipped test images train, the rest validate
IMAGES_MAGIC, LABELS_MAGIC = 2051, 2049
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
MIRROR = "https://ossci-datasets.s3.amazonaws.com/mnist/"  # torchvision's mirror of LeCun's files


class IdxError(ValueError):
    """An IDX file is corrupt, truncated or of the wrong kind; the message names the file."""


def read_idx(path: str | Path, magic: int | None = None) -> np.ndarray:
    """Read one IDX file (gzipped or raw) into a uint8 array of the shape its header states.

    ``magic``: the expected magic number (2051 images, 2049 labels), checked when given.
    Raises FileNotFoundError for a missing file and :class:`IdxError` for a bad one.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"MNIST file not found: {path}")
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":  # the gzip signature
            raw = gzip.decompress(raw)
    except (OSError, EOFError) as exc:
        raise IdxError(f"{path}: not a readable gzip file ({exc})") from exc
    if len(raw) < 4:
        raise IdxError(f"{path}: {len(raw)} bytes, too short for an IDX header")
    zero, dtype, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype != 0x08:
        raise IdxError(f"{path}: not an unsigned-byte IDX file (header bytes {raw[:4].hex()})")
    found = struct.unpack(">i", raw[:4])[0]
    if magic is not None and found != magic:
        raise IdxError(f"{path}: magic number {found}, expected {magic}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise IdxError(f"{path}: truncated header ({len(raw)} bytes, needs {header})")
    dims = struct.unpack(f">{ndim}i", raw[4:header])
    expected = header + int(np.prod(dims))
    if len(raw) != expected:
        raise IdxError(
            f"{path}: {len(raw)} bytes but its header {dims} implies {expected} (truncated?)"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _find(root: Path, stem: str) -> Path:
    for name in (stem + ".gz", stem):
        if (root / name).is_file():
            return root / name
    raise FileNotFoundError(
        f"MNIST file not found: {root / stem}(.gz) -- pass root= a folder with the IDX files"
    )


def load_pair(
    images_path: str | Path, labels_path: str | Path
) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images ``(N, 28, 28)`` and int64 labels ``(N,)``, validated against each other."""
    images = read_idx(images_path, IMAGES_MAGIC)
    labels = read_idx(labels_path, LABELS_MAGIC)
    if images.ndim != 3 or images.shape[1:] != (28, 28):
        raise IdxError(f"{images_path}: images of shape {images.shape}, expected (N, 28, 28)")
    if labels.ndim != 1 or len(labels) != len(images):
        raise IdxError(
            f"{labels_path}: {labels.shape} labels for {len(images)} images in {images_path}"
        )
    if labels.size and labels.max() > 9:
        raise IdxError(f"{labels_path}: label {int(labels.max())} outside 0-9")
    return torch.from_numpy(images.copy()), torch.from_numpy(labels.astype(np.int64))


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 ``(N, 28, 28)`` -> float32 ``(N, 1, 28, 28)``, zero-mean unit-variance-ish."""
    x = images.to(torch.float32).div_(255.0).unsqueeze(1)  # (N, 28, 28) -> (N, 1, 28, 28)
    return x.sub_(MEAN).div_(STD)


class MNIST(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Normalised MNIST digits held in memory; ``split`` is ``"train"`` or ``"val"``.

    ``root=None`` uses the shipped 10k split (8,000 train / 2,000 val); ``root=DIR`` the full
    60k training set and the 10k test set as validation. ``limit`` keeps the first N items.
    """

    def __init__(
        self, split: str = "train", root: str | Path | None = None, limit: int | None = None
    ):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        if root is None:
            images, labels = load_pair(
                shipped("mnist/t10k-images-idx3-ubyte.gz"),
                shipped("mnist/t10k-labels-idx1-ubyte.gz"),
            )
            part = slice(0, OFFLINE_TRAIN) if split == "train" else slice(OFFLINE_TRAIN, None)
            images, labels = images[part], labels[part]
        else:
            stems = FILES["train" if split == "train" else "test"]
            images, labels = load_pair(_find(Path(root), stems[0]), _find(Path(root), stems[1]))
        if limit is not None:
            images, labels = images[:limit], labels[:limit]
        self.images = normalize(images)  # (N, 1, 28, 28)
        self.labels = labels  # (N,)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


def _holds(path: Path, magic: int, count: int) -> bool:
    try:
        return path.is_file() and len(read_idx(path, magic)) == count
    except IdxError:
        return False


def download(dest: str | Path, mirror: str = MIRROR) -> Path:
    """Fetch the four original MNIST files into ``dest`` (needs a network; tests never call it).

    Each file is validated with :func:`read_idx` (magic, shape, length: 60,000 train and
    10,000 test items) before it is kept, so a broken transfer fails here, naming the file.
    Files already present and valid are not fetched again. Returns ``dest`` for
    ``MNIST(root=dest)``.
    """
    dest = make_private_dir(dest, 0o755, parents=True, exist_ok=True, what="data folder")
    for split, stems in FILES.items():
        count = 60000 if split == "train" else 10000
        for stem, magic in zip(stems, (IMAGES_MAGIC, LABELS_MAGIC)):
            target = dest / f"{stem}.gz"
            if not _holds(target, magic, count):
                tmp = target.with_suffix(".part")
                with urllib.request.urlopen(mirror + target.name) as got:  # noqa: S310 - fixed https mirror
                    write_private(tmp, got.read(), perm=0o644, overwrite=True)  # no link followed
                if not _holds(tmp, magic, count):
                    raise IdxError(f"{mirror + target.name}: expected {count} items")
                tmp.replace(target)
    return dest
