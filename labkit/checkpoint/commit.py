"""The commit protocol shared by synchronous and asynchronous saves, with no collective after
the start, so it can run in a background thread while training runs collectives.

``save_checkpoint`` (``sharded.py``) commits with a barrier and an ``all_gather_object``.
A background writer cannot: a collective issued from a second thread interleaves with the
training thread's collectives in a different order on different ranks (NCCL would hang,
gloo would pair the wrong messages). So the ranks meet through the shared filesystem instead:

1. :func:`prepare` (the main thread, collective, once per save): rank 0 restores a displaced
   ``.prev-step_N``, clears debris of a crashed save of this step and creates
   ``.tmp-step_N/``; a barrier; from here on no rank communicates about this save;
2. :func:`write_part` (every rank, any thread): its files, each fsynced, then
   ``part_RRRRR.json`` (their sizes and sha256, and what the rank wrote) written under a
   temporary name and renamed: a part file exists only once everything it describes is durable;
3. :func:`commit` (rank 0, any thread): waits until all ``world_size`` part files exist, merges
   them into ``metadata.json`` (written last, fsynced), and publishes the folder as ``step_N``
   (:func:`labkit.checkpoint.publish.publish`: commit record, rename, ``latest.json``, prune).

A crash at any instant before the rename leaves a ``.tmp-*`` folder that readers ignore, so
the previous committed step stays the newest; a rank that dies before its part appears makes
rank 0's :func:`commit` time out with the missing ranks named, and nothing is committed.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from labkit.checkpoint.layout import (
    CheckpointError,
    prune,
    restore_displaced,
    step_dir,
    write_durable,
)
from labkit.checkpoint.publish import publish
from labkit.safe_files import check_folder, make_private_dir

__all__ = ["Fault", "commit", "part_name", "prepare", "prune", "rank_and_size", "write_part"]

Fault = Callable[[str], None]  # fault(point): a test hook; raises or kills at "written", ...


def rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def part_name(rank: int) -> str:
    return f"part_{rank:05d}.json"


def prepare(root: Path, step: int, group: dist.ProcessGroup | None) -> tuple[Path, Path]:
    """Collective over ``group``: the empty ``.tmp-step_N`` folder every rank writes into, and
    the ``step_N`` it will become. Returns (tmp, final)."""
    rank, world = rank_and_size(group)
    tmp, final = root / f".tmp-step_{step:08d}", step_dir(root, step)
    if rank == 0:
        # root: the caller's folder, checked (ours, no one else can write it or a folder
        # above it) or created; tmp: new, 0700, exclusive (safe_files: never through a link)
        if os.path.lexists(root):
            check_folder(root, what="checkpoint folder")
        else:
            make_private_dir(root, 0o755, parents=True, what="checkpoint folder")
        restore_displaced(root)  # before pruning can count (or delete) anything
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a crashed save of this step
        make_private_dir(tmp)
    if world > 1:
        dist.barrier(group)
    return tmp, final


def write_part(
    tmp: Path, rank: int, files: dict[str, bytes], record: dict[str, Any], fault: Fault | None
) -> None:
    """Write this rank's ``files`` durably, then its part record (sizes, sha256, ``record``)."""
    written = {name: write_durable(tmp / name, data) for name, data in files.items()}
    if fault is not None:
        fault("written")  # shards durable, part record not yet: a crash here commits nothing
    part = tmp / part_name(rank)
    scratch = part.with_suffix(".json.partial")
    write_durable(scratch, json.dumps({"rank": rank, "files": written, **record}).encode())
    os.rename(scratch, part)  # the part appears whole or not at all


def _wait_parts(tmp: Path, world: int, timeout: float, abort: threading.Event | None) -> list[Any]:
    deadline = time.monotonic() + timeout
    names = [part_name(r) for r in range(world)]
    while True:
        missing = [r for r, n in enumerate(names) if not (tmp / n).is_file()]
        if not missing:
            try:
                return [json.loads((tmp / n).read_bytes()) for n in names]
            except ValueError as exc:
                raise CheckpointError(f"a part record under {tmp} is unreadable: {exc}") from exc
        if (abort is not None and abort.is_set()) or time.monotonic() > deadline:
            raise CheckpointError(
                f"not committing {tmp}: ranks {missing} of {world} never wrote their part "
                f"within {timeout:.0f} s (a rank died or was interrupted mid-save)"
            )
        time.sleep(0.002)


def commit(
    root: Path,
    tmp: Path,
    final: Path,
    world: int,
    merge: Callable[[list[Any]], dict[str, Any]],
    *,
    keep: int,
    timeout: float = 600.0,
    fault: Fault | None = None,
    abort: threading.Event | None = None,
) -> Path:
    """Rank 0: wait for every part, write ``merge(parts)`` as ``metadata.json``, rename."""
    parts = _wait_parts(tmp, world, timeout, abort)
    meta = merge(parts)
    meta["files"] = {k: v for p in parts for k, v in p["files"].items()}
    data = json.dumps(meta, indent=1).encode()
    write_durable(tmp / "metadata.json", data)
    if fault is not None:
        fault("before_commit")
    return publish(root, tmp, final, meta["step"], data, keep)
