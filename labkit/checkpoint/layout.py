"""The on-disk layout of a sharded checkpoint, and the durable-file steps it is written with.

Split from ``sharded.py`` (save and load, whose docstring describes the layout and the commit
protocol): this module holds the pieces both sides must agree on -- the folder names
(``step_N``, ``.prev-step_N``), the flat ZeRO range each rank owns (:func:`shard_range`),
how a state tree becomes a skeleton plus named tensors (:func:`split_tree` /
:func:`join_tree`), and a write that is on the disk when it returns (:func:`write_durable`).
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from labkit.safe_files import open_private

__all__ = [
    "FORMAT",
    "PREV",
    "STEP_DIR",
    "TENSOR",
    "CheckpointError",
    "commit_folder",
    "committed_steps",
    "fsync_dir",
    "join_tree",
    "load_verified",
    "prune",
    "restore_displaced",
    "shard_range",
    "split_tree",
    "step_dir",
    "to_bytes",
    "write_durable",
]

FORMAT = "labkit-sharded-v1"
STEP_DIR = re.compile(r"^step_(\d{8})$")
PREV = ".prev-"  # a committed step displaced by a re-save of the same step, until it commits
TENSOR = "__labkit_tensor__"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the file."""


def shard_range(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """The flat range ``[start, end)`` of a tensor with ``numel`` elements owned by ``rank``."""
    chunk = math.ceil(numel / world_size) if numel else 0
    return min(rank * chunk, numel), min((rank + 1) * chunk, numel)


# ------------------------------------------------------------------ state trees <-> tensors
def split_tree(tree: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Replace every tensor in ``tree`` by a placeholder; collect them under '/'-joined keys."""
    if isinstance(tree, torch.Tensor):
        if path in tensors:
            raise ValueError(f"two tensors map to the same checkpoint key {path!r}")
        tensors[path] = tree
        return {TENSOR: path}
    if isinstance(tree, dict):
        return {k: split_tree(v, f"{path}/{k}", tensors) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(split_tree(v, f"{path}/{i}", tensors) for i, v in enumerate(tree))
    return tree


def join_tree(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, dict):
        if set(skeleton) == {TENSOR}:
            return tensors[skeleton[TENSOR]]
        return {k: join_tree(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list | tuple):
        return type(skeleton)(join_tree(v, tensors) for v in skeleton)
    return skeleton


# ------------------------------------------------------------------ durable files
def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> dict[str, Any]:
    """Write ``data``, flush it to the disk, return its size and sha256 for the metadata."""
    with open_private(path, "wb") as f:  # exclusive, no link followed, 0600
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def committed_steps(root: Path) -> dict[int, Path]:
    """Every committed step under ``root`` and its folder: ``step_N``, or ``.prev-step_N`` when
    a re-save of step N crashed between its two renames (``step_N`` wins when both exist)."""
    found: dict[int, Path] = {}
    for p in sorted(root.iterdir(), key=lambda p: not p.name.startswith(PREV)):  # .prev- first
        m = STEP_DIR.match(p.name.removeprefix(PREV))
        if m and (p / "metadata.json").is_file():
            found[int(m[1])] = p  # step_N, listed after .prev-step_N, overrides it
    return found


def restore_displaced(root: Path) -> None:
    """Undo a re-save that crashed between its renames: ``.prev-step_N`` back to ``step_N``
    when ``step_N`` is missing; otherwise the re-save committed and the old copy is debris."""
    for prev in root.glob(f"{PREV}step_*"):
        final = root / prev.name.removeprefix(PREV)
        if final.exists():
            shutil.rmtree(prev, ignore_errors=True)
        else:
            os.rename(prev, final)
    fsync_dir(root)


def commit_folder(root: Path, tmp: Path, final: Path) -> Path:
    """The commit: ``tmp`` (complete, its metadata on the disk) becomes ``final`` by a rename.
    Re-saving a committed step first moves the old copy aside as ``.prev-step_N``, still
    readable as step N (:func:`committed_steps`) until the rename; so at every instant a
    committed step N exists."""
    prev = root / f"{PREV}{final.name}"
    if final.exists():  # re-saving a step (after resuming from an older one)
        os.rename(final, prev)
    os.rename(tmp, final)
    fsync_dir(root)
    shutil.rmtree(prev, ignore_errors=True)
    return final


def prune(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` committed steps; old ones become ``.trash-*`` before deletion
    (a half-deleted folder never looks like a checkpoint). A ``.tmp-step_M`` is debris of a
    crashed save only when M is not newer than the newest commit (saves run one at a time,
    so a newer one may be an asynchronous save still in flight)."""
    committed = sorted(p for p in root.iterdir() if STEP_DIR.match(p.name))
    for old in committed[:-keep]:
        os.rename(old, root / f".trash-{old.name}-{time.time_ns()}")
    newest = committed[-1].name if committed else ""
    stale = [t for t in root.glob(".tmp-step_*") if t.name.removeprefix(".tmp-") <= newest]
    for debris in [*root.glob(".trash-*"), *stale]:
        shutil.rmtree(debris, ignore_errors=True)


# ------------------------------------------------------------------ verified reads
def load_verified(
    file: Path, expected: dict[str, Any] | None, holds: str = "", *, verify_only: bool = False
) -> Any:
    """``file`` checked against its metadata entry (size, sha256), then unpickled with
    ``weights_only`` (tensors and plain containers: never run code from a file). ``holds``
    names what the file carries, for the error when it is missing."""
    if expected is None or not file.is_file():
        raise CheckpointError(f"checkpoint file is missing: {file}{holds and f' (holds {holds})'}")
    data = file.read_bytes()
    if len(data) != expected["bytes"]:
        raise CheckpointError(
            f"checkpoint file is truncated: {file} has {len(data)} bytes, "
            f"expected {expected['bytes']}"
        )
    if hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise CheckpointError(f"checkpoint file is corrupt (sha256 mismatch): {file}")
    if verify_only:
        return None
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:
        raise CheckpointError(f"cannot load {file} with weights_only=True: {exc}") from exc
