"""The one way labkit writes files: into folders no one else controls, never through a link.

labkit often runs as root (a netns or Slurm cluster needs it) and writes files a process will
later trust: job pickles, a munge key, a ``slurm.conf`` whose ``Prolog=`` runs as root,
checkpoints. If another user can write the folder, or any folder above it, they can plant a
symbolic link where labkit is about to write (root then overwrites a file of their choosing),
or swap the file after it is written and before it is read. So every write goes through here:

* **folders** (:func:`check_folder`): the real path (links above the folder resolved once,
  the folder itself never a link) is checked component by component with ``os.lstat``: each
  is owned by root or by this user, and none above the folder may be writable by others
  unless it is sticky (``/tmp`` is ``1777``: others cannot rename what is ours out of it). The
  folder itself is a directory owned by this user that no one else can write (nor read,
  unless ``others_may_read``);
* **new folders** (:func:`make_private_dir`): ``os.mkdir`` then ``fchmod`` to the mode asked
  for, so the mode never depends on the umask (under umask 002 a plain mkdir gives 0775);
* **new files** (:func:`open_private`, :func:`write_private`, :func:`replace_private`):
  ``O_CREAT | O_EXCL | O_NOFOLLOW`` in a checked folder: a file that already exists, link or
  not, is never opened for writing; the mode is set with ``fchmod`` (umask-independent).
  Appending (``"a"``), or reading and writing in place (:func:`open_shared_fd`: a file the
  ranks of one job share), opens an existing file only when ``fstat`` says it is a regular file of
  this user with one link and no write access for others.

A check that fails raises :class:`UnsafePathError` (a ``PermissionError``) naming the path,
what is wrong and how to fix it. Each check is a few ``lstat`` calls (microseconds).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import IO, Any

__all__ = ["UnsafePathError", "check_folder", "check_private_dir", "make_private_dir",
           "open_private", "open_shared_fd", "write_private", "replace_private"]  # fmt: skip

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_FLAGS = {"w": os.O_WRONLY | os.O_CREAT | os.O_EXCL, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
          "rw": os.O_RDWR | os.O_CREAT}  # fmt: skip


class UnsafePathError(PermissionError):
    """A path another user could control: labkit refuses to write (or read) there."""


def _refuse(path: str | Path, problem: str, fix: str, what: str = "folder") -> UnsafePathError:
    return UnsafePathError(
        f"labkit refuses the {what} {path}: {problem}. Another user could replace or redirect "
        f"the files labkit writes there (and so make it overwrite or trust their files). "
        f"Fix: {fix}"
    )


def check_private_dir(
    path: str | Path, *, others_may_read: bool = False, what: str = "folder"
) -> None:
    """Raise unless ``path`` is a real directory (not a link) owned by this user that no one
    else can write (nor read, unless ``others_may_read``)."""
    st = os.lstat(path)
    uid = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(path, "it is a symbolic link", f"remove the link (rm {path})", what)
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "it is not a directory", f"remove it (rm {path})", what)
    if st.st_uid != uid:
        raise _refuse(path, f"it is owned by uid {st.st_uid}, not by you (uid {uid})",
                      "remove it (as its owner or root), or pass a folder of your own",
                      what)  # fmt: skip
    mode = stat.S_IMODE(st.st_mode)
    forbidden = 0o022 if others_may_read else 0o077
    if mode & forbidden:
        who = "others can write it" if mode & 0o022 else "others can read it"
        wanted = "go-w" if others_may_read else "700"
        raise _refuse(path, f"{who} (mode {mode:04o})", f"chmod {wanted} {path}", what)


def _check_ancestors(real: Path, what: str) -> None:
    """Every folder above ``real`` (a resolved path): owned by root or this user, and not
    writable by others unless sticky (then others cannot rename our entries out of it)."""
    uid = os.geteuid()
    for folder in reversed(real.parents):
        st = os.lstat(folder)
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid not in (0, uid):
            raise _refuse(real, f"the folder above it, {folder}, is owned by uid {st.st_uid}",
                          "use a folder whose parents only you or root own", what)  # fmt: skip
        if mode & 0o022 and not mode & stat.S_ISVTX:
            raise _refuse(real, f"others can write the folder above it, {folder} "
                          f"(mode {mode:04o}), and it is not sticky",
                          f"chmod go-w {folder} (or chmod +t), or use another folder",
                          what)  # fmt: skip


def check_folder(path: str | Path, *, others_may_read: bool = True, what: str = "folder") -> Path:
    """The real path of an existing folder fit to write into (see the module doc): it and
    every folder above it checked. Links above it are resolved (once); the folder itself must
    not be a link. Returns the resolved path: use it, not ``path``."""
    path = Path(os.path.abspath(path))
    real = Path(os.path.realpath(path.parent)) / path.name
    _check_ancestors(real, what)
    check_private_dir(real, others_may_read=others_may_read, what=what)
    return real


def make_private_dir(
    path: str | Path, mode: int = 0o700, *, parents: bool = False, exist_ok: bool = False,
    what: str = "folder",
) -> Path:  # fmt: skip
    """Create folder ``path`` with exactly ``mode`` (no group/other write bits allowed),
    whatever the umask; ``parents``: missing folders above it too, with the same mode.
    ``exist_ok``: an existing one is accepted when :func:`check_folder` passes for it (others
    may read it only when ``mode`` lets them). Returns the resolved path."""
    if mode & 0o022:
        raise ValueError(f"make_private_dir: mode {mode:04o} lets others write {path}")
    path = Path(os.path.abspath(path))
    missing = []
    while not os.path.lexists(path):
        missing.append(path.name)
        if not parents and len(missing) > 1:
            raise FileNotFoundError(f"no folder {path} to create {path / missing[0]} in")
        path = path.parent
    if not missing:
        if not exist_ok:
            raise FileExistsError(f"{path} exists (labkit creates its folders new)")
        return check_folder(path, others_may_read=bool(mode & 0o077), what=what)
    real = Path(os.path.realpath(path))
    _check_ancestors(real / missing[-1], what)  # where we create: ours or root's, not open
    for name in reversed(missing):
        real = real / name
        try:
            os.mkdir(real, 0o700)  # 0700 until fchmod below: never more open than asked
        except FileExistsError:  # another process of the job made it just now
            if not exist_ok:
                raise
            check_private_dir(real, others_may_read=bool(mode & 0o077), what=what)
            continue
        fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW | _CLOEXEC)
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                raise _refuse(real, "it is not owned by you right after mkdir", "retry", what)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
    return real


def _open_fd(path: str | Path, mode: str, perm: int, what: str, overwrite: bool = False) -> int:
    if perm & 0o022:
        raise ValueError(f"open_private: mode {perm:04o} lets others write {path}")
    kind = mode.replace("b", "").replace("x", "w")
    if kind not in _FLAGS or len(mode) > 2 or (kind == "rw" and mode != "rw"):
        raise ValueError(f"open_private: mode {mode!r} is not one of w, wb, x, xb, a, ab")
    path = Path(path)
    folder = check_folder(path.parent, others_may_read=True, what=what)
    target = folder / path.name
    if overwrite and kind == "w":
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)  # a link goes, never followed; the folder is ours alone
    try:
        fd = os.open(target, _FLAGS[kind] | _NOFOLLOW | _CLOEXEC, 0o600)
    except FileExistsError:
        raise FileExistsError(
            errno.EEXIST,
            f"labkit creates {target} only as a new file, and "
            "something is already there (a file, or a link it never "
            "follows): remove it or use a new folder",
            str(target),
        ) from None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise _refuse(target, "it is a symbolic link", f"remove it (rm {target})", "file") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            raise _refuse(target, f"it is not a regular file of yours with one link "
                          f"(uid {st.st_uid}, links {st.st_nlink})", f"remove {target}",
                          "file")  # fmt: skip
        if stat.S_IMODE(st.st_mode) & 0o022:
            raise _refuse(target, f"others can write it (mode {stat.S_IMODE(st.st_mode):04o})",
                          f"remove {target}", "file")  # fmt: skip
        os.fchmod(fd, perm)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_private(
    path: str | Path, mode: str = "wb", *, perm: int = 0o600, overwrite: bool = False,
    what: str = "folder",
) -> IO[Any]:  # fmt: skip
    """Open ``path`` for writing in a checked folder, never through a link: ``"w"``/``"wb"``
    (same as ``"x"``/``"xb"``) create it new (``FileExistsError`` when it exists, unless
    ``overwrite``: whatever is there is removed first, a link included, never followed);
    ``"a"``/``"ab"`` append, creating it when missing. The file's mode is ``perm``
    (umask-independent). Text modes are UTF-8."""
    fd = _open_fd(path, mode, perm, what, overwrite)
    if "b" in mode:
        return os.fdopen(fd, "ab" if "a" in mode else "wb")
    return os.fdopen(fd, "a" if "a" in mode else "w", encoding="utf-8")


def open_shared_fd(path: str | Path, *, perm: int = 0o600, what: str = "folder") -> int:
    """A raw descriptor for reading and writing ``path`` in place (``pread``/``pwrite``,
    ``lockf``), created when missing: for a file the processes of one job share. No link is
    followed, and an existing file must pass the same checks as for appending."""
    return _open_fd(path, "rw", perm, what)


def write_private(
    path: str | Path, data: bytes | str, *, perm: int = 0o600, sync: bool = False,
    overwrite: bool = False,
) -> Path:  # fmt: skip
    """Create ``path`` new (exclusive, no link followed, mode ``perm``) holding ``data``
    (str: UTF-8); ``sync``: fsync before returning; ``overwrite``: as for
    :func:`open_private`. Returns ``path``."""
    raw = data.encode() if isinstance(data, str) else data
    with open_private(path, "wb", perm=perm, overwrite=overwrite) as f:
        f.write(raw)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    return Path(path)


def replace_private(
    path: str | Path, data: bytes | str, *, perm: int = 0o600, sync: bool = True
) -> Path:
    """Atomically set ``path`` to ``data``: a new temporary file beside it (exclusive, no
    link followed), fsynced, then ``os.replace`` (which replaces a link, never follows it).
    A reader sees the old whole file or the new whole file, never a part. Returns ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        write_private(tmp, data, perm=perm, sync=sync)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync:
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
        try:
            os.fsync(fd)  # the rename itself survives a crash
        finally:
            os.close(fd)
    return path
