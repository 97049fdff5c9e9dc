"""Where a job's files live: a folder only its user can write, checked on every use.

A launch ships its job as a pickle (``job.pkl``) and its ranks answer with pickles
(``result.N.pkl``); unpickling runs code. Whoever can write those files, or swap the folder
that holds them, runs code as the launching user (as root, for a netns cluster). So:

* the runs root is per user, ``<tempdir>/labkit-runs-<uid>``, created mode 0700;
* every use checks it with ``os.lstat`` (a symbolic link is never followed): a real directory,
  owned by this user, that no one else can write (the default root: no access for anyone
  else, mode ``& 0o077 == 0``); and every folder above it is root's or this user's and, when
  others can write there, sticky (``/tmp`` is ``1777``), so that no one else can rename the
  root away after the check (:mod:`labkit.safe_files` does the checks and the writes);
* each run is a fresh ``mkdtemp`` (mode 0700, a name no one could have created first) inside;
* the agent checks its run folder again before it unpickles anything (:func:`check_run_dir`);
* the launching process holds an ``flock`` on the run's ``live.lock`` while the run lives
  (:class:`LiveRun`): old runs are pruned by age and count, but never a live one.

A folder that fails a check is refused with a :class:`PermissionError` that names the path,
what is wrong and how to fix it; nothing is ever loaded from it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import IO, Any

from labkit.safe_files import (
    UnsafePathError,
    check_folder,
    check_private_dir,
    make_private_dir,
    open_private,
)

LIVE_LOCK = "live.lock"  # flocked by the launching process for the run's life


def default_root() -> Path:
    """``<tempdir>/labkit-runs-<uid>``: this user's runs (checked by :func:`runs_root`)."""
    return Path(tempfile.gettempdir()) / f"labkit-runs-{os.geteuid()}"


def check_private(path: Path, *, others_may_read: bool = False) -> None:
    """Raise unless ``path`` is a real directory (not a link) owned by this user that no one
    else can write (nor read, unless ``others_may_read``): :func:`labkit.safe_files.
    check_private_dir`, worded for a runs folder."""
    check_private_dir(path, others_may_read=others_may_read, what="runs folder")


def runs_root(log_dir: Path | None = None) -> Path:
    """The checked root of this user's runs: ``log_dir`` when given (others may read it, never
    write it; created mode 0755 whatever the umask), else :func:`default_root` (private,
    created mode 0700 on first use). Every folder above it is checked too (safe_files)."""
    if log_dir is not None:
        chosen = Path(log_dir).resolve()  # the user's choice: follow their links, check it
        return make_private_dir(chosen, 0o755, parents=True, exist_ok=True, what="runs folder")
    return make_private_dir(default_root(), 0o700, exist_ok=True, what="runs folder")


class LiveRun:
    """The launching process's hold on its run folder: an exclusive ``flock`` on
    ``<run>/live.lock`` for as long as the run lives. :func:`prune_old_runs` never deletes a
    run whose lock is held; the kernel drops it when the holder dies, however (SIGKILL too),
    so a killed launcher's run becomes prunable. The file is close-on-exec: the agent and the
    ranks never hold it."""

    def __init__(self, run: Path) -> None:
        self.file: IO[Any] | None = open_private(run / LIVE_LOCK, "wb", what="runs folder")
        fcntl.flock(self.file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: free

    def release(self) -> None:
        """The run is finished: from now on it may be pruned."""
        if self.file is not None:
            self.file.close()
            self.file = None


def new_run_dir(root: Path, kind: str = "") -> tuple[Path, LiveRun]:
    """A fresh run folder (mode 0700) in ``root``, named by time: ``[kind-]YYYYmmdd-HHMMSS-``,
    and the caller's :class:`LiveRun` hold on it (release it when the run ends)."""
    prefix = kind + time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6] + "-"
    run = Path(tempfile.mkdtemp(prefix=prefix, dir=root))  # 0700, a name no one made first
    return run, LiveRun(run)


def check_run_dir(run: Path) -> None:
    """The reader's side (the agent, a rank): a run folder must be private before anything in
    it is unpickled; its root, and every folder above, must not be writable by others."""
    check_private(run)
    check_folder(run.parent, others_may_read=True, what="runs folder")


def is_live(run: Path) -> bool:
    """Whether some process holds ``run``'s :class:`LiveRun` lock (a folder without one is
    finished: a run of an older labkit, or a launch that failed before taking it)."""
    try:
        fd = os.open(run / LIVE_LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def prune_old_runs(root: Path, keep: int = 30, min_age_s: float = 3600.0) -> list[str]:
    """Delete finished run folders beyond the newest ``keep``: never a live one (its lock is
    held, :func:`is_live`), never one touched in the last ``min_age_s`` (a launch may be
    between ``mkdtemp`` and taking its lock). Returns the names deleted."""
    gone = []
    with contextlib.suppress(OSError):
        runs = sorted(root.iterdir(), key=lambda p: p.lstat().st_mtime)
        now = time.time()
        for old in runs[:-keep] if keep else runs:
            if old.is_symlink() or not old.is_dir() or now - old.lstat().st_mtime <= min_age_s:
                continue
            if not is_live(old):
                shutil.rmtree(old, ignore_errors=True)
                gone.append(old.name)
    return gone


__all__ = ["LIVE_LOCK", "LiveRun", "UnsafePathError", "check_private", "check_run_dir",
           "default_root", "is_live", "new_run_dir", "prune_old_runs", "runs_root"]  # fmt: skip
