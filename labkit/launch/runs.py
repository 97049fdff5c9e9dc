"""Where a job's files live: a folder only its user can write, checked on every use.

A launch ships its job as a pickle (``job.pkl``) and its ranks answer with pickles
(``result.N.pkl``); unpickling runs code. Whoever can write those files, or swap the folder
that holds them, runs code as the launching user (as root, for a netns cluster). So:

* the runs root is per user, ``<tempdir>/labkit-runs-<uid>``, created mode 0700;
* every use checks it with ``os.lstat`` (a symbolic link is never followed): a real directory,
  owned by this user, that no one else can write (the default root: no access for anyone
  else, mode ``& 0o077 == 0``); and its parent, when others can write there, must be sticky
  (``/tmp`` is ``1777``), so that no one else can rename the root away after the check;
* each run is a fresh ``mkdtemp`` (mode 0700, a name no one could have created first) inside;
* the agent checks its run folder again before it unpickles anything (:func:`check_run_dir`).

A folder that fails a check is refused with a :class:`PermissionError` that names the path,
what is wrong and how to fix it; nothing is ever loaded from it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import time
import uuid
from pathlib import Path


def default_root() -> Path:
    """``<tempdir>/labkit-runs-<uid>``: this user's runs (checked by :func:`runs_root`)."""
    return Path(tempfile.gettempdir()) / f"labkit-runs-{os.geteuid()}"


def _refuse(path: Path, problem: str, fix: str) -> PermissionError:
    return PermissionError(
        f"labkit refuses the runs folder {path}: {problem}. Another user could replace the "
        f"job files that labkit unpickles (and so run code as you). Fix: {fix}"
    )


def check_private(path: Path, *, others_may_read: bool = False) -> None:
    """Raise unless ``path`` is a real directory (not a link) owned by this user that no one
    else can write (nor read, unless ``others_may_read``)."""
    st = os.lstat(path)
    uid = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(path, "it is a symbolic link", f"remove the link (rm {path})")
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "it is not a directory", f"remove it (rm {path})")
    if st.st_uid != uid:
        raise _refuse(
            path,
            f"it is owned by uid {st.st_uid}, not by you (uid {uid})",
            "remove it (as its owner or root), or pass log_dir= a folder of your own",
        )
    mode = stat.S_IMODE(st.st_mode)
    forbidden = 0o022 if others_may_read else 0o077
    if mode & forbidden:
        who = "others can write it" if mode & 0o022 else "others can read it"
        wanted = "go-w" if others_may_read else "700"
        raise _refuse(path, f"{who} (mode {mode:04o})", f"chmod {wanted} {path}")


def _check_parent(path: Path) -> None:
    """Others who can write the parent may rename ``path`` away, unless the parent is sticky."""
    parent = path.parent
    st = os.stat(parent)
    if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
        raise _refuse(
            path,
            f"its parent {parent} is writable by everyone and not sticky "
            f"(mode {stat.S_IMODE(st.st_mode):04o})",
            f"chmod +t {parent}, or point TMPDIR (or log_dir=) at a folder of your own",
        )


def runs_root(log_dir: Path | None = None) -> Path:
    """The checked root of this user's runs: ``log_dir`` when given (others may read it, never
    write it), else :func:`default_root` (private, created mode 0700 on first use)."""
    if log_dir is not None:
        root = Path(log_dir).resolve()  # the user chose it: follow their links, check the target
        root.mkdir(parents=True, exist_ok=True)
        check_private(root, others_may_read=True)
        return root
    root = default_root()
    _check_parent(root)
    with contextlib.suppress(FileExistsError):
        os.mkdir(root, 0o700)
    check_private(root)
    return root


def new_run_dir(root: Path, kind: str = "") -> Path:
    """A fresh run folder (mode 0700) in ``root``, named by time: ``[kind-]YYYYmmdd-HHMMSS-``."""
    prefix = kind + time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6] + "-"
    return Path(tempfile.mkdtemp(prefix=prefix, dir=root))


def check_run_dir(run: Path) -> None:
    """The reader's side (the agent, a rank): a run folder must be private before anything in
    it is unpickled; its root must not be writable by others."""
    check_private(run)
    check_private(run.parent, others_may_read=True)


def prune_old_runs(root: Path, keep: int = 30, min_age_s: float = 3600.0) -> None:
    """Delete all but the newest ``keep`` run folders, never one touched in the last hour
    (a concurrent launch may still be writing there)."""
    with contextlib.suppress(OSError):
        runs = sorted(root.iterdir(), key=lambda p: p.lstat().st_mtime)
        now = time.time()
        for old in runs[:-keep]:
            if now - old.lstat().st_mtime > min_age_s and old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
