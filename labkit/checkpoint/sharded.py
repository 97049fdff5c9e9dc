"""Sharded training checkpoints: every rank writes its slice, one metadata file commits them.

Saving, the atomic commit and verified, resharding loads are here; the layout both sides
agree on (folder names, flat ranges, state trees as skeleton + tensors, durable writes) is in
``layout.py``, re-exported here where callers import it.

On-disk layout of one checkpoint (``root/step_00000042/``)::

    metadata.json     format, step, world_size, sha256 + size of every file, and for every
                      tensor: shape, dtype and which rank holds which flat range [start, end)
    commit.json       the size and sha256 of metadata.json (``publish.py``)
    common.pt         rank 0: the non-tensor skeleton of the state (optimizer hyper-parameters,
                      scaler, sampler position...) with a placeholder where each tensor was
    shard_00003.pt    rank 3: its slice of every tensor, plus its own per-rank state (RNG)

Why slices of *flattened* tensors: tensor ``k`` with ``n`` elements is cut into ``world_size``
contiguous ranges of ``ceil(n / world_size)`` (the ZeRO partition). Any other world size
can then read any range it needs -- the full tensor for a data-parallel replica, or just its
own new ZeRO range -- by intersecting ranges recorded in the metadata: resharding is a pure
function of the metadata, not of how many ranks wrote it. Per-rank state (RNG streams) does
*not* reshard: 4 generators cannot become 3. :meth:`Checkpoint.rank_state` returns None
when the world size changed; a run that must continue identically on a different world
size derives its randomness from (seed, step, sample) instead (see :mod:`labkit.labs.drill`).

Atomicity (a crash at any instant never destroys the previous good checkpoint):

1. all ranks write into ``root/.tmp-step_00000042/`` (new, 0700; files created exclusively,
   never through a link: :mod:`labkit.safe_files`); each file is fsynced;
2. rank 0 writes ``metadata.json`` (with every shard's sha256), then ``commit.json`` (the
   metadata's sha256), fsyncs them and the folder;
3. rank 0 publishes (:func:`labkit.checkpoint.publish.publish`): moves aside any committed
   step newer than this one (a resumed run's abandoned trajectory), renames the folder to
   ``step_00000042``, fsyncs ``root``, points ``root/latest.json`` at it -- the commit -- and
   drops all but the newest ``keep`` checkpoints up to it (renamed to ``.trash-*`` first, so a
   half-deleted folder never looks like a checkpoint; never the one just committed).

Re-saving a step that already exists (after resuming from an older one) needs two renames,
since a folder cannot atomically replace a non-empty one: the old ``step_N`` becomes
``.prev-step_N``, then ``.tmp-step_N`` becomes ``step_N``, then ``.prev-step_N`` is deleted.
A crash between the two renames leaves only ``.prev-step_N``: readers treat it as step ``N``
whenever ``step_N`` is absent, and the next save renames it back before pruning, so no
instant is without the last good checkpoint.

Readers open the step ``latest.json`` names (or one asked for), never a ``.tmp-*`` folder (a
crash before step 3's rename leaves one: deleted by the next save's prune). Loading checks
the metadata against ``commit.json`` and field by field (``validate.py``: any fault is a
:class:`CheckpointError` naming the file), every file's size and sha256 before unpickling,
and the tensors against the model (:meth:`Checkpoint.expect`), and unpickles with
``weights_only=True`` (tensors and plain containers only, never arbitrary code). Every reader
hashes every file, which is fine at this kit's sizes; at scale each rank would verify only the
shards it reads. Assumes a filesystem all ranks share.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from labkit.checkpoint.commit import prepare, rank_and_size
from labkit.checkpoint.layout import (
    FORMAT,
    CheckpointError,
    join_tree,
    load_verified,
    shard_range,
    split_tree,
    to_bytes,
    write_durable,
)
from labkit.checkpoint.match import check_one_to_one
from labkit.checkpoint.publish import committed_folder, latest_step, publish, read_record
from labkit.checkpoint.validate import read_metadata

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "latest_step",
    "load_checkpoint",
    "save_checkpoint",
    "shard_range",
]


# ------------------------------------------------------------------ save
def save_checkpoint(
    root: str | Path,
    step: int,
    state: dict[str, Any],
    *,
    rank_state: dict[str, Any] | None = None,
    keep: int = 3,
    group: dist.ProcessGroup | None = None,
    before_commit: Callable[[], None] | None = None,
) -> Path:
    """Save ``state`` (replicated on every rank: model, optimizer, scaler, sampler...) as
    slices, plus this rank's ``rank_state`` (RNG...). Collective over ``group``: every rank
    calls it. Returns the committed folder once every rank's shard is durable.

    ``before_commit`` runs on every rank after its shard is on disk and before anything is
    committed: a hook for fault-injection tests. Works without a process group (world of 1).
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    distributed = dist.is_available() and dist.is_initialized()
    rank, world_size = rank_and_size(group)
    root = Path(root)
    tmp, final = prepare(root, step, group)  # collective: the empty .tmp-step_N, and step_N

    tensors: dict[str, torch.Tensor] = {}
    skeleton = split_tree(state, "", tensors)
    slices: dict[str, torch.Tensor] = {}
    table: dict[str, dict[str, Any]] = {}
    for key, t in tensors.items():
        start, end = shard_range(t.numel(), rank, world_size)
        # .clone(): save only the slice, not the whole storage the view points into
        slices[key] = t.detach().reshape(-1)[start:end].clone().cpu()
        table[key] = {
            "shape": list(t.shape),
            "dtype": str(t.dtype).removeprefix("torch."),
            "numel": t.numel(),
        }
    name = f"shard_{rank:05d}.pt"
    mine = {
        name: write_durable(
            tmp / name, to_bytes({"slices": slices, "rank_state": rank_state or {}})
        )
    }
    if before_commit is not None:
        before_commit()

    gathered: list[Any] = [None] * world_size
    if distributed:
        dist.all_gather_object(gathered, mine, group=group)
    else:
        gathered = [mine]

    if rank == 0:
        files = {k: v for part in gathered for k, v in part.items()}
        files["common.pt"] = write_durable(tmp / "common.pt", to_bytes({"skeleton": skeleton}))
        for entry in table.values():
            entry["slices"] = [
                [r, *shard_range(entry["numel"], r, world_size)] for r in range(world_size)
            ]
        meta = {"format": FORMAT, "step": step, "world_size": world_size, "time": time.time(),
                "files": files, "tensors": table}  # fmt: skip
        data = json.dumps(meta, indent=1).encode()
        write_durable(tmp / "metadata.json", data)
        publish(root, tmp, final, step, data, keep)
    if distributed:
        dist.barrier(group)  # nobody moves on until the checkpoint is committed
    return final


# ------------------------------------------------------------------ load
class Checkpoint:
    """A verified, committed checkpoint. Reads any world size's shards for any world size."""

    def __init__(self, path: Path):
        self.path = path
        self.meta = read_metadata(path, FORMAT, read_record(path))
        self.step: int = self.meta["step"]
        self.world_size: int = self.meta["world_size"]
        self._cache: dict[str, Any] = {}
        for name in self.meta["files"]:  # fail now, naming the file, not halfway through a load
            self._read(name, verify_only=True)

    def _read(self, name: str, verify_only: bool = False) -> Any:
        if name in self._cache:
            return self._cache[name]
        obj = load_verified(self.path / name, self.meta["files"][name], verify_only=verify_only)
        if verify_only:
            return None
        self._cache[name] = obj
        return obj

    def read_slice(self, key: str, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Elements ``[start, end)`` of tensor ``key`` flattened, reading only the shards
        that overlap the range: what a rank of a *new* world size asks for."""
        entry = self.meta["tensors"][key]
        end = entry["numel"] if end is None else end
        pieces, dtype = [], getattr(torch, entry["dtype"])
        for rank, s, e in entry["slices"]:
            lo, hi = max(s, start), min(e, end)
            if lo < hi:
                name = f"shard_{rank:05d}.pt"
                piece = self._field(name, "slices", key)
                ok = isinstance(piece, torch.Tensor) and piece.shape == (e - s,)
                if not ok or piece.dtype != dtype:
                    raise CheckpointError(f"{self.path / name}: its slice of {key!r} is not "
                                          f"{e - s} elements of {dtype}")  # fmt: skip
                pieces.append(piece[lo - s : hi - s])
        return torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype)

    def _field(self, name: str, *keys: str) -> Any:
        """``file[keys[0]][keys[1]]...`` of a verified file, or a CheckpointError naming it."""
        obj = self._read(name)
        try:
            for k in keys:
                obj = obj[k]
        except (KeyError, TypeError, IndexError) as exc:
            raise CheckpointError(f"{self.path / name} lacks {'/'.join(keys)}: {exc!r}") from exc
        return obj

    def expect(self, shapes: dict[str, tuple[int, ...]], prefix: str = "") -> None:
        """Refuse unless the saved tensors under ``prefix`` are exactly ``shapes`` (keys
        without the prefix), one to one, naming the first that differs."""
        saved = {k.removeprefix(prefix): tuple(e["shape"])
                 for k, e in self.meta["tensors"].items() if k.startswith(prefix)}  # fmt: skip
        check_one_to_one(self.path, saved, shapes)

    def tensor(self, key: str) -> torch.Tensor:
        entry = self.meta["tensors"][key]
        return self.read_slice(key).reshape(entry["shape"])  # (numel,) -> saved shape

    def state(self) -> dict[str, Any]:
        """The full replicated state, as it was passed to :func:`save_checkpoint` (on CPU)."""
        skeleton = self._field("common.pt", "skeleton")
        return join_tree(skeleton, {key: self.tensor(key) for key in self.meta["tensors"]})

    def rank_state(self, rank: int, world_size: int) -> dict[str, Any] | None:
        """What ``rank`` saved as its own state, or None when the checkpoint was written by a
        different world size (per-rank streams do not reshard)."""
        if world_size != self.world_size or not 0 <= rank < world_size:
            return None
        state: dict[str, Any] = self._field(f"shard_{rank:05d}.pt", "rank_state")
        return state


def load_checkpoint(root: str | Path, step: int | None = None) -> Checkpoint:
    """Open checkpoint ``step`` (default: the newest committed one) under ``root``, verified."""
    path = committed_folder(root, step)
    return Checkpoint(path)
