"""Logical checkpoints: each tensor once, at its global shape, with every shard's place in it.

A 3D run (dp x tp x pp, ZeRO-1) holds each parameter as a tensor-parallel box, replicated over
dp, with its optimizer state cut again into ZeRO ranges. The checkpoint records what the
tensors *are*, not how the run held them, so any other layout can read it
(:mod:`labkit.checkpoint.reshard`):

    metadata.json       format, step, world size, the saving layout (for the record), every
                        file's size and sha256, JSON objects (scaler, step counts...), and per
                        tensor: global shape, dtype, the dim tensor parallelism cuts
                        (``tp_dim``) and its chunks: ``{file, item, offsets, sizes, flat}``
    rank_RRRRR.pt       rank R's chunks ``{"tensors": {key: [data, ...]}, "rank_state": ...}``
    part_RRRRR.json     what rank R wrote (the commit protocol, :mod:`labkit.checkpoint.commit`)
    commit.json         the size and sha256 of metadata.json (:mod:`labkit.checkpoint.publish`)

Written once: a rank lists only the chunks it *owns* (:class:`LogicalState`): tensor-parallel
shards from every tp rank, replicated tensors from tp rank 0, ZeRO ranges from their dp
owner, full-replica tensors from dp rank 0 (:mod:`labkit.checkpoint.zero_state` decides);
:func:`labkit.checkpoint.reshard.plan_read` refuses two chunks covering one element. Loading
checks shapes and coverage and names the tensor and both shapes; every file read is checked
against its sha256 first (a flipped byte is refused) and unpickled ``weights_only``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from labkit.checkpoint.layout import CheckpointError, load_verified, to_bytes
from labkit.checkpoint.publish import committed_folder, read_record
from labkit.checkpoint.reshard import Place, plan_read
from labkit.checkpoint.validate import read_metadata

__all__ = ["FORMAT", "LogicalCheckpoint", "LogicalState", "encode", "load_logical", "merge"]

FORMAT = "labkit-logical-v1"
CHUNK_FIELDS = ("file", "item", "offsets", "sizes", "flat")


@dataclass
class LogicalState:
    """What one rank contributes to a logical checkpoint: the chunks it owns
    (``key -> [(data, place)]``; ``data``: the place's elements in row-major order, any shape),
    ``tp_dims`` (key -> the dim tensor parallelism cuts, for :func:`check_split`), JSON
    ``objects`` (equal on every rank that sends one), this rank's ``rank_state`` (RNG: not
    resharded) and the ``layout`` that saved it (for the record and same-layout restores)."""

    chunks: dict[str, list[tuple[torch.Tensor, Place]]] = field(default_factory=dict)
    tp_dims: dict[str, int | None] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    rank_state: dict[str, Any] = field(default_factory=dict)
    layout: dict[str, Any] = field(default_factory=dict)

    def add(self, key: str, data: torch.Tensor, place: Place, tp_dim: int | None = None) -> None:
        if data.numel() != place.numel:
            raise ValueError(f"{key}: {data.numel()} elements for a place of {place.numel}")
        self.chunks.setdefault(key, []).append((data, place))
        self.tp_dims[key] = tp_dim


def encode(state: LogicalState, rank: int) -> tuple[dict[str, bytes], dict[str, Any]]:
    """This rank's file and its part record (call off the training path: it serializes)."""
    name = f"rank_{rank:05d}.pt"
    tensors = {k: [d.detach().reshape(-1) for d, _ in v] for k, v in state.chunks.items()}
    chunks = {
        k: [{"file": name, "item": i, "shape": list(p.shape), "offsets": list(p.offsets),
             "sizes": list(p.sizes), "flat": None if p.flat is None else list(p.flat),
             "dtype": str(d.dtype).removeprefix("torch.")} for i, (d, p) in enumerate(v)]
        for k, v in state.chunks.items()
    }  # fmt: skip
    data = to_bytes({"tensors": tensors, "rank_state": state.rank_state})
    record = {"chunks": chunks, "tp_dims": state.tp_dims, "objects": state.objects,
              "layout": state.layout}  # fmt: skip
    return {name: data}, record


def merge(parts: list[dict[str, Any]], step: int) -> dict[str, Any]:
    """Rank 0: the metadata of every rank's part records, tensor by tensor."""
    tensors: dict[str, dict[str, Any]] = {}
    objects: dict[str, Any] = {}
    for part in parts:
        for key, chunks in part["chunks"].items():
            first = chunks[0]
            fresh = {"shape": first["shape"], "dtype": first["dtype"], "chunks": []}
            entry = tensors.setdefault(key, {**fresh, "tp_dim": part["tp_dims"][key]})
            for c in chunks:
                if c["shape"] != entry["shape"]:
                    raise CheckpointError(
                        f"tensor {key!r}: rank {part['rank']} saved a shard of shape "
                        f"{c['shape']}, another rank one of {entry['shape']}"
                    )
                entry["chunks"].append({k: c[k] for k in CHUNK_FIELDS})
        for key, value in part["objects"].items():
            objects.setdefault(key, value)
    return {"format": FORMAT, "step": step, "world_size": len(parts), "time": time.time(),
            "layout": parts[0]["layout"], "objects": objects, "tensors": tensors}  # fmt: skip


class LogicalCheckpoint:
    """A committed logical checkpoint; any layout reads any shard of it (:meth:`read`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.meta: dict[str, Any] = read_metadata(path, FORMAT, read_record(path))
        self.step: int = self.meta["step"]
        self.world_size: int = self.meta["world_size"]
        self.tensors: dict[str, dict[str, Any]] = self.meta["tensors"]
        self.objects: dict[str, Any] = self.meta["objects"]
        self.layout: dict[str, Any] = self.meta["layout"]
        self._cache: dict[str, Any] = {}

    def _holds(self, name: str) -> str:
        keys = [k for k, e in self.tensors.items() if any(c["file"] == name for c in e["chunks"])]
        return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")

    def _read(self, name: str) -> Any:
        """Rank file ``name``, verified (size, sha256) and unpickled weights_only, cached."""
        if name in self._cache:
            return self._cache[name]
        obj = load_verified(self.path / name, self.meta["files"].get(name), self._holds(name))
        self._cache[name] = obj
        return obj

    def verify(self) -> None:
        """Check every file now (a loader that reads only its shards checks only those)."""
        for name in self.meta["files"]:
            if name.startswith("rank_"):
                self._read(name)

    def entry(self, key: str, shape: tuple[int, ...] | None = None) -> dict[str, Any]:
        """Tensor ``key``'s metadata; with ``shape``, refuse another global shape, naming both."""
        if key not in self.tensors:
            raise CheckpointError(f"tensor {key!r} is not in checkpoint {self.path} "
                                  f"(a checkpoint of another model?)")  # fmt: skip
        entry = self.tensors[key]
        if shape is not None and tuple(entry["shape"]) != tuple(shape):
            raise CheckpointError(
                f"tensor {key!r}: the checkpoint holds shape {tuple(entry['shape'])}, "
                f"the model expects {tuple(shape)}"
            )
        return entry

    def read(self, key: str, want: Place, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The elements of ``want`` (row-major, 1-D) of tensor ``key``, from the saved chunks
        that overlap it (only their files are read)."""
        entry = self.entry(key, want.shape)
        shape = tuple(entry["shape"])
        saved = [
            Place(shape, tuple(c["offsets"]), tuple(c["sizes"]), c["flat"] and tuple(c["flat"]))
            for c in entry["chunks"]
        ]
        plan, covered = plan_read(saved, want)
        if covered != want.numel:
            raise CheckpointError(
                f"tensor {key!r} of shape {tuple(want.shape)}: the saved shards cover {covered} "
                f"of the {want.numel} elements at offsets {want.offsets} sizes {want.sizes} "
                f"flat {want.flat} (a missing shard)"
            )
        out = torch.empty(want.numel, dtype=getattr(torch, entry["dtype"]))
        for k, src, dst, n in plan:
            c = entry["chunks"][k]
            data = self._chunk(c["file"], key, c["item"], saved[k].numel, out.dtype)
            out[dst : dst + n] = data[src : src + n]
        return out if dtype is None else out.to(dtype)

    def _chunk(
        self, name: str, key: str, item: int, numel: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Chunk ``item`` of ``key`` in rank file ``name``: ``numel`` elements of ``dtype``,
        or a CheckpointError naming the file (it disagrees with the metadata)."""
        try:
            data = self._read(name)["tensors"][key][item]
        except (KeyError, TypeError, IndexError) as exc:
            raise CheckpointError(f"{self.path / name} lacks chunk {item} of {key!r}") from exc
        if not isinstance(data, torch.Tensor) or (data.shape, data.dtype) != ((numel,), dtype):
            raise CheckpointError(f"{self.path / name}: chunk {item} of {key!r} is not "
                                  f"{numel} elements of {dtype}")  # fmt: skip
        return data

    def full(self, key: str) -> torch.Tensor:
        """Tensor ``key`` whole, at its global shape."""
        shape = tuple(self.entry(key)["shape"])
        return self.read(key, Place.whole(shape)).reshape(shape)

    def rank_state(self, rank: int, layout: dict[str, Any]) -> dict[str, Any] | None:
        """What ``rank`` saved as its own state, when ``layout`` is the one that saved it
        (None otherwise: per-rank streams do not reshard)."""
        if json.loads(json.dumps(layout)) != self.layout:  # tuples come back from JSON as lists
            return None
        name = f"rank_{rank:05d}.pt"
        state = self._read(name).get("rank_state") if self.meta["files"].get(name) else None
        if not isinstance(state, dict):
            raise CheckpointError(f"{self.path / name}: no rank_state for rank {rank}")
        return state


def load_logical(root: str | Path, step: int | None = None) -> LogicalCheckpoint:
    """Open logical checkpoint ``step`` (default: the newest committed one) under ``root``."""
    path = committed_folder(root, step)
    return LogicalCheckpoint(path)
