"""What "committed" and "latest" mean: a commit record per step, a pointer per root.

A step folder is complete once it holds ``commit.json`` (the metadata's size and sha256,
written after ``metadata.json`` and fsynced: the metadata is verified like every shard).
The *latest* checkpoint is the step named by ``root/latest.json``, rewritten (temp + fsync +
rename) at every commit -- not the largest step number. Why: a run that resumes from step 10
while steps 20, 30 of an abandoned trajectory exist saves 11, 12, ...; "largest number"
would resume a restart from 30, and pruning by number would delete each new save (keep=1).

Publishing step S (rank 0, :func:`publish`), in this order, so a crash at any instant leaves
``latest.json`` naming a complete folder:

1. committed steps newer than S (the abandoned trajectory) are retired: the pointer first
   names the newest step <= S (or none), then each newer folder becomes
   ``.abandoned-step_T-<ns>`` (kept, never deleted: it is someone's work; readers ignore it);
2. ``.tmp-step_S`` becomes ``step_S`` (:func:`~labkit.checkpoint.layout.commit_folder`);
3. the pointer names S -- the commit;
4. all but the newest ``keep`` steps <= S are pruned: never S itself.

The pointer carries its own check (sha256 of its step), so a flipped digit is refused, not
read as another step. A root without a pointer (one folder copied by hand) falls back to its
newest committed folder. Files are written through :mod:`labkit.safe_files` (no link
followed, exclusive create, private modes).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

from labkit.checkpoint.layout import (
    PREV,
    STEP_DIR,
    CheckpointError,
    commit_folder,
    committed_steps,
    fsync_dir,
    prune,
    step_dir,
)
from labkit.safe_files import replace_private, write_private

__all__ = ["POINTER", "RECORD", "committed_folder", "latest_step", "publish", "read_record"]

POINTER = "latest.json"
RECORD = "commit.json"
ABANDONED = ".abandoned-"


def _check_of(step: int | None) -> str:
    return hashlib.sha256(f"labkit-latest:{step}".encode()).hexdigest()


def _write_pointer(root: Path, step: int | None) -> None:
    replace_private(root / POINTER, json.dumps({"step": step, "check": _check_of(step)}))


def read_pointer(root: Path) -> tuple[bool, int | None]:
    """(whether ``root/latest.json`` exists, the step it names: None for "nothing yet")."""
    file = root / POINTER
    if not os.path.lexists(file):
        return False, None
    try:
        ptr = json.loads(file.read_bytes())
        step = ptr["step"]
        ok = (step is None or type(step) is int) and ptr["check"] == _check_of(step)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint pointer {file} is unreadable: {exc!r}") from exc
    if not ok:
        raise CheckpointError(f"checkpoint pointer {file} is corrupt (its check does not match)")
    return True, step


def latest_step(root: str | Path) -> int | None:
    """The step of the last commit under ``root`` (``latest.json``; without one, the newest
    committed folder); None when nothing was committed."""
    root = Path(root)
    if not root.is_dir():
        return None
    found, step = read_pointer(root)
    return step if found else max(committed_steps(root), default=None)


def committed_folder(root: str | Path, step: int | None = None) -> Path:
    """The folder of committed step ``step`` (default: the latest) under ``root``: ``step_N``,
    or ``.prev-step_N`` when a re-save of it crashed between its renames."""
    root = Path(root)
    if step is None:
        step = latest_step(root)
        if step is None:
            raise CheckpointError(f"no committed checkpoint ({POINTER} or step_*/) under {root}")
    path = step_dir(root, step)
    if not path.is_dir():
        path = path.with_name(PREV + path.name)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint folder {step_dir(root, step)} "
                              f"(named by {root / POINTER} or asked for)")  # fmt: skip
    return path


def _digest(data: bytes) -> dict[str, Any]:
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def seal(tmp: Path, step: int, metadata: bytes) -> None:
    """The commit record of a complete ``tmp`` folder: the metadata's size and sha256."""
    record = {"step": step, "metadata.json": _digest(metadata)}
    write_private(tmp / RECORD, json.dumps(record), sync=True)
    fsync_dir(tmp)


def read_record(path: Path) -> dict[str, Any]:
    """``path/commit.json`` (what the metadata must hash to), or a CheckpointError naming it."""
    file = path / RECORD
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path} has no commit record {file} (an unfinished "
                              f"save, or one written before commit records existed)")  # fmt: skip
    try:
        record: dict[str, Any] = json.loads(file.read_bytes())
        meta = record["metadata.json"]
        ok = type(meta["bytes"]) is int and isinstance(meta["sha256"], str)
        ok = ok and type(record["step"]) is int
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"commit record {file} is unreadable: {exc!r}") from exc
    if not ok:
        raise CheckpointError(f"commit record {file} has fields of the wrong type")
    m = STEP_DIR.match(path.name.removeprefix(PREV))
    if m and int(m[1]) != record["step"]:
        raise CheckpointError(f"commit record {file} is of step {record['step']}, not {m[1]}")
    return record


def _retire_newer(root: Path, step: int) -> None:
    """Move committed steps newer than ``step`` aside (see the module doc), pointer first."""
    steps = committed_steps(root)
    newer = sorted(s for s in steps if s > step)
    if not newer:
        return
    _write_pointer(root, max((s for s in steps if s <= step), default=None))
    for s in newer:
        aside = root / f"{ABANDONED}{step_dir(root, s).name}-{time.time_ns()}"
        os.rename(steps[s], aside)
        warnings.warn(f"checkpoint step {s} under {root} is newer than the step being saved "
                      f"({step}): a resumed run abandoned it; moved aside to {aside.name}",
                      RuntimeWarning, stacklevel=3)  # fmt: skip
    fsync_dir(root)


def publish(root: Path, tmp: Path, final: Path, step: int, metadata: bytes, keep: int) -> Path:
    """Rank 0: commit the complete ``tmp`` (its ``metadata.json`` durable) as ``final``."""
    seal(tmp, step, metadata)
    _retire_newer(root, step)
    commit_folder(root, tmp, final)
    _write_pointer(root, step)  # the commit: from here on a restart resumes from ``step``
    prune(root, keep)
    return final
