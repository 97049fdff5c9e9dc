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
(``dcp.save``, ``dcp.load``, ``FileSystemReader.read_metadata``), so they keep working as
DCP's format moves; the price is one copy on disk, made offline. Single process (no process
group: ``no_dist=True``), CPU tensors; model parameters only (moments stay labkit's).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from labkit.checkpoint.async_save import save_logical
from labkit.checkpoint.logical import LogicalCheckpoint, LogicalState
from labkit.checkpoint.reshard import Place

__all__ = ["from_dcp", "to_dcp"]


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
    meta = dcp.FileSystemReader(str(src)).read_metadata()
    tensors = {
        k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for k, m in meta.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    with _one_process():
        dcp.load(tensors, checkpoint_id=str(src), no_dist=True)
    state = LogicalState(layout={"source": "dcp"})
    for alias, canonical in (aliases or {}).items():
        tied = alias in tensors and canonical in tensors
        if tied and not torch.equal(tensors.pop(alias), tensors[canonical]):
            raise ValueError(f"{src}: {alias!r} differs from {canonical!r}, its tied tensor")
    for name, t in tensors.items():
        state.add(prefix + name, t.reshape(-1), Place.whole(tuple(t.shape)))
    return save_logical(root, step, state)
