"""Interoperability with ``torch.distributed.checkpoint`` (DCP), both ways, by conversion.

* :func:`to_dcp`: a labkit logical checkpoint -> a DCP checkpoint of a plain module's state
  dict (``wte.weight``, ``blocks.0.attn.q.weight``, ... at full shape), which
  ``dcp.load(model.state_dict(), checkpoint_id=...)`` reads into an unsharded model;
* :func:`from_dcp`: a DCP checkpoint of the same model -> a logical checkpoint, which any
  labkit layout then loads (:func:`labkit.checkpoint.zero_state.restore`).

Why converters, not DCP-compatible metadata written beside our files: DCP's ``.metadata`` is
a pickle of private classes (``_StorageInfo``: which byte range of which file holds a chunk)
whose fields have changed between releases, and a DCP chunk is a box (offsets, sizes) while
a ZeRO range is a flat slice of a box (:class:`~labkit.checkpoint.reshard.Place`): optimizer
state could not be described at all. The converters use only DCP's public entry points
(``dcp.save``, ``dcp.load``, ``FileSystemReader``), so they keep working as DCP's format
moves; the price is one copy on disk, made offline. DCP reads ``.metadata`` with a plain
``pickle.load`` (it runs whatever code the file names), so :func:`from_dcp` reads it with a
restricted unpickler that resolves only DCP's metadata classes (:data:`ALLOWED`). Single
process (no process group: ``no_dist=True``), CPU tensors; model parameters only (moments
stay labkit's).
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from labkit.checkpoint.async_save import save_logical
from labkit.checkpoint.layout import CheckpointError
from labkit.checkpoint.logical import LogicalCheckpoint, LogicalState
from labkit.checkpoint.reshard import Place
from labkit.safe_files import check_folder, make_private_dir

__all__ = ["SafeReader", "from_dcp", "read_dcp_metadata", "to_dcp"]

_DCP = "torch.distributed.checkpoint"
ALLOWED = {  # (module, name) DCP's .metadata may name: plain records, no code runs on load
    **{(f"{_DCP}.metadata", n): "a metadata record" for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")},
    (f"{_DCP}.filesystem", "_StorageInfo"): "which byte range of which file holds a chunk",
    ("torch", "Size"): "a shape",
    ("torch.serialization", "_get_layout"): "a torch.layout looked up by its name",
    ("pathlib", "PosixPath"): "the checkpoint_id recorded in StorageMeta",
    ("pathlib", "PurePosixPath"): "the checkpoint_id recorded in StorageMeta",
    ("collections", "OrderedDict"): "a dict",
}  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only :data:`ALLOWED` names and torch dtypes: a planted
    ``.metadata`` naming anything else (``os.system``, ``builtins.open``...) is refused before
    it is called."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata class")


def read_dcp_metadata(src: str | Path) -> Metadata:
    """DCP's ``src/.metadata``, unpickled with :class:`_MetadataUnpickler`; a
    :class:`CheckpointError` naming the file when it names anything else or is not DCP's."""
    file = Path(src) / ".metadata"
    try:
        meta = _MetadataUnpickler(io.BytesIO(file.read_bytes())).load()
    except Exception as exc:  # noqa: BLE001 - any failure to parse is a bad file, named
        raise CheckpointError(f"refusing DCP metadata {file}: {exc}") from exc
    if not isinstance(meta, Metadata):
        raise CheckpointError(f"refusing DCP metadata {file}: it holds a {type(meta).__name__}")
    return meta


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, its one plain ``pickle.load`` (the ``.metadata``) replaced by the
    metadata read once with :func:`read_dcp_metadata` and checked: a file swapped between
    that read and ``dcp.load`` cannot turn a tensor into a pickled object (DCP loads those
    with ``weights_only=False``). Tensors DCP reads ``weights_only`` itself."""

    def __init__(self, path: str | Path, metadata: Metadata) -> None:
        super().__init__(str(path))
        self._checked = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.path}: per-rank DCP metadata is not supported")
        storage = self._checked.storage_meta or StorageMeta()
        storage.load_id = self.load_id
        self._checked.storage_meta = storage
        return self._checked


@contextmanager
def _one_process() -> Iterator[None]:
    """DCP warns that it assumes one process when no group exists: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def to_dcp(
    ckpt: LogicalCheckpoint,
    out: str | Path,
    *,
    prefix: str = "model/",
    aliases: dict[str, str] | None = None,
) -> list[str]:
    """Write ``ckpt``'s tensors under ``prefix`` as a DCP checkpoint in ``out``, keyed without
    the prefix; ``aliases`` (``{"head.weight": "wte.weight"}``) adds the keys a plain module's
    state dict has for a tied tensor stored once. Returns the keys written."""
    state = {k.removeprefix(prefix): ckpt.full(k) for k in ckpt.tensors if k.startswith(prefix)}
    for alias, canonical in (aliases or {}).items():
        state[alias] = state[canonical]
    # DCP's own writer follows links: write only into a folder no one else can write
    if os.path.lexists(out):
        check_folder(out, what="DCP output folder")
    else:
        make_private_dir(out, 0o755, parents=True, what="DCP output folder")
    with _one_process():
        dcp.save(state, checkpoint_id=str(out), no_dist=True)
    return sorted(state)


def from_dcp(
    src: str | Path,
    root: str | Path,
    step: int,
    *,
    prefix: str = "model/",
    aliases: dict[str, str] | None = None,
) -> Path:
    """Read every tensor of the DCP checkpoint ``src`` at full shape and commit it as logical
    checkpoint ``step`` under ``root`` (keys ``prefix + name``). Alias keys are checked equal
    to their canonical tensor and stored once. Returns the committed folder."""
    meta = read_dcp_metadata(src)  # never a plain unpickle: the file may be anyone's
    try:
        tensors = {
            k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
            for k, m in meta.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)
        }
    except (AttributeError, TypeError, ValueError, RuntimeError) as exc:
        file = Path(src) / ".metadata"
        raise CheckpointError(f"DCP metadata {file} is malformed: {exc!r}") from exc
    with _one_process():
        dcp.load(tensors, storage_reader=SafeReader(src, meta), no_dist=True)
    state = LogicalState(layout={"source": "dcp"})
    for alias, canonical in (aliases or {}).items():
        tied = alias in tensors and canonical in tensors
        if tied and not torch.equal(tensors.pop(alias), tensors[canonical]):
            raise ValueError(f"{src}: {alias!r} differs from {canonical!r}, its tied tensor")
    for name, t in tensors.items():
        state.add(prefix + name, t.reshape(-1), Place.whole(tuple(t.shape)))
    return save_logical(root, step, state)
