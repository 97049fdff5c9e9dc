"""The metadata of a checkpoint read back: checked against its commit record, then field by
field, so that whatever is wrong becomes a :class:`CheckpointError` naming the file.

The sha256 in ``commit.json`` (:mod:`~labkit.checkpoint.publish`) catches a damaged
``metadata.json``; the field checks catch a well-formed file of the wrong shape (another
version, a bug): without them a bad entry surfaces later as ``torch has no attribute
float33``, ``list index out of range`` or a bare ``KeyError`` that names no file.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch

from labkit.checkpoint.layout import FORMAT as SHARDED
from labkit.checkpoint.layout import CheckpointError
from labkit.checkpoint.reshard import Place

__all__ = ["read_metadata"]


class _Bad(ValueError):
    pass


def _int(v: Any, what: str, low: int = 0) -> int:
    if type(v) is not int or v < low:
        raise _Bad(f"{what} is {v!r}, not an int >= {low}")
    return v


def _ints(v: Any, what: str, n: int | None = None) -> list[int]:
    if not isinstance(v, list) or (n is not None and len(v) != n):
        raise _Bad(f"{what} is {v!r}, not a list of {n if n is not None else 'some'} ints")
    return [_int(x, what) for x in v]


def _dict(v: Any, what: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _Bad(f"{what} is not an object")
    return v


def _dtype(v: Any, what: str) -> None:
    if not isinstance(v, str) or not isinstance(getattr(torch, v, None), torch.dtype):
        raise _Bad(f"{what} {v!r} is not a torch dtype")


def _files(meta: dict[str, Any]) -> dict[str, Any]:
    files = _dict(meta["files"], "files")
    for name, e in files.items():
        if "/" in name or name.startswith("."):
            raise _Bad(f"file name {name!r} leaves the checkpoint folder")
        _int(_dict(e, f"files[{name!r}]")["bytes"], f"files[{name!r}].bytes")
        if not isinstance(e["sha256"], str):
            raise _Bad(f"files[{name!r}].sha256 is not a string")
    return files


def _sharded(meta: dict[str, Any], files: dict[str, Any]) -> None:
    world = meta["world_size"]
    for key, e in _dict(meta["tensors"], "tensors").items():
        shape = _ints(e["shape"], f"{key}.shape")
        _dtype(e["dtype"], f"{key}.dtype")
        if _int(e["numel"], f"{key}.numel") != math.prod(shape):
            raise _Bad(f"{key}.numel {e['numel']} != the product of shape {shape}")
        for sl in e["slices"]:
            r, s, end = _ints(sl, f"{key}.slices", 3)
            if not (r < world and s <= end <= e["numel"]) or f"shard_{r:05d}.pt" not in files:
                raise _Bad(f"{key}.slices entry {sl} is outside the tensor or the files")
    if "common.pt" not in files:
        raise _Bad("files lacks common.pt")


def _logical(meta: dict[str, Any], files: dict[str, Any]) -> None:
    _dict(meta["objects"], "objects")
    _dict(meta["layout"], "layout")
    for key, e in _dict(meta["tensors"], "tensors").items():
        shape = tuple(_ints(e["shape"], f"{key}.shape"))
        _dtype(e["dtype"], f"{key}.dtype")
        if e["tp_dim"] is not None and not 0 <= _int(e["tp_dim"], f"{key}.tp_dim") < len(shape):
            raise _Bad(f"{key}.tp_dim {e['tp_dim']} is not a dim of shape {shape}")
        for c in e["chunks"]:
            if c["file"] not in files:
                raise _Bad(f"{key}: a chunk names {c['file']!r}, not a file of the checkpoint")
            _int(c["item"], f"{key}.item")
            flat = c["flat"] and tuple(_ints(c["flat"], f"{key}.flat", 2))
            n = len(shape)
            Place(shape, tuple(_ints(c["offsets"], f"{key}.offsets", n)),
                  tuple(_ints(c["sizes"], f"{key}.sizes", n)), flat)  # fmt: skip


def read_metadata(path: Path, fmt: str, record: dict[str, Any]) -> dict[str, Any]:
    """``path/metadata.json`` of format ``fmt``, verified against the commit ``record``."""
    file = path / "metadata.json"
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path} has no metadata file {file}")
    data = file.read_bytes()
    want = record["metadata.json"]
    if len(data) != want["bytes"] or hashlib.sha256(data).hexdigest() != want["sha256"]:
        raise CheckpointError(f"metadata file {file} is corrupt: its size or sha256 differs "
                              f"from its commit record {path / 'commit.json'}")  # fmt: skip
    try:
        meta = _dict(json.loads(data), "the metadata")
        if meta.get("format") != fmt:
            raise _Bad(f"unknown format {meta.get('format')!r}, expected {fmt!r}")
        if _int(meta["step"], "step") != record["step"]:
            raise _Bad(f"step {meta['step']} differs from the commit record's {record['step']}")
        _int(meta["world_size"], "world_size", 1)
        (_sharded if fmt == SHARDED else _logical)(meta, _files(meta))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"metadata file {file} is malformed: {exc!r}") from exc
    return meta
