"""What a Slurm cluster leaves when its caller is killed: removed at once, or at the next start.

:func:`labkit.cluster.slurm.slurm_cluster` tears down on every way out it sees. A SIGKILL of
the caller is one it cannot see: the job's :class:`~labkit.launch.lifeline.Lifeline` watchdog
kills the daemons and job steps, but nothing removes the run's network namespaces, their
``/etc/netns`` entries, its record in ``/run/labkit-cluster`` or its own folder in ``/tmp``.

The **reaper** does. It is this file run as ``python -I -S slurm_reaper.py`` (stdlib only, the
caller's side aside: no torch, it starts in milliseconds) in a session of its own and without
the job's run id, so neither the watchdog nor a terminal's Ctrl-C ends it. The caller *tells it
what it creates, before creating it*, one line per object on the reaper's stdin (``netns
NAME``, ``path PATH``); the reaper only reads. When the caller's write end closes (the kernel
closes it when the caller dies, however it dies), the reaper removes every object it was told
of: processes left in a namespace, the namespace, then the paths. A caller that tore down
itself writes ``done`` first (:meth:`Reaper.close`), and the reaper exits without touching
anything (a later run may reuse a name). An object announced but never created costs a failed
``ip`` or ``rm``: nothing.

The **sweep at the next start** (:func:`sweep_stale_runs`) is the fallback for the windows the
reaper cannot cover (the reaper itself killed, the machine rebooted mid-run): a run folder
holds a ``creator`` file (pid and start time); a folder whose creator is gone is removed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

__all__ = ["Reaper", "process_id", "sweep_stale_runs", "RUN_PREFIX"]

RUN_PREFIX = "labkit-slurm-"  # the run folders a cluster makes itself, in the temp folder


class Reaper:
    """The caller's side: start the reaper, announce objects, close it after the teardown."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        """``env``: added to the reaper's otherwise bare environment (a test's tag)."""
        path = os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__)],
            stdin=subprocess.PIPE,  # non-inheritable write end: only this process holds it
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={"PATH": path, **(env or {})},  # not the job's run id: the watchdog spares it
            start_new_session=True,
        )

    def track(self, kind: str, value: str | Path) -> None:
        """Announce an object before creating it (``kind``: ``netns`` or ``path``)."""
        if kind not in ("netns", "path") or "\n" in str(value):
            raise ValueError(f"cannot track {kind!r} {str(value)!r}")
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{kind} {value}\n".encode())
        self.proc.stdin.flush()  # announced = written to the pipe: the kernel holds it now

    def own_folder(self) -> Path:
        """A new private run folder in the temp folder, announced before it is made, with the
        ``creator`` file :func:`sweep_stale_runs` reads."""
        from labkit.safe_files import make_private_dir, write_private  # the caller's side only

        run = Path(tempfile.gettempdir(), f"{RUN_PREFIX}{uuid.uuid4().hex[:12]}")
        self.track("path", run)
        run = make_private_dir(run, 0o700, what="Slurm run folder")
        write_private(run / "creator", process_id(os.getpid()))
        return run

    def close(self, clean: bool) -> None:
        """End the reaper and wait for it: ``clean``, the caller removed everything itself and
        the reaper exits without acting; otherwise it removes what it was told of now."""
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            if clean:
                self.proc.stdin.write(b"done\n")
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def process_id(pid: int) -> str:
    """``pid`` plus its start time (field 22 of /proc/pid/stat): a recycled pid differs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return f"{pid} {stat.rsplit(')', 1)[1].split()[19]}"


def sweep_stale_runs(root: str | Path | None = None) -> list[str]:
    """Remove run folders (``labkit-slurm-*`` in ``root``, the temp folder by default) whose
    ``creator`` is gone; a folder without a creator file is left alone (it may be starting)."""
    gone = []
    for run in Path(root or tempfile.gettempdir()).glob(f"{RUN_PREFIX}*"):
        try:
            creator = (run / "creator").read_text().strip()
            if run.is_symlink() or run.stat().st_uid != os.geteuid():
                continue  # only this user's own folders
        except OSError:
            continue
        parts = creator.split()
        if len(parts) == 2 and parts[0].isdigit() and process_id(int(parts[0])) != creator:
            shutil.rmtree(run, ignore_errors=True)
            gone.append(run.name)
    return gone


def _reap(lines: list[str]) -> None:
    """Remove the announced objects: namespaces (and what still runs inside) first, then
    paths, newest first (an ``/etc/netns`` entry before the folder that holds it)."""
    items = [line.split(" ", 1) for line in lines if " " in line]
    for kind, name in items:
        if kind == "netns":
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                                  text=True).stdout.split()  # fmt: skip
            for pid in pids:
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
    for kind, name in reversed(items):
        if kind == "path":
            path = Path(name)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    path.unlink()
    with contextlib.suppress(OSError):
        Path("/etc/netns").rmdir()  # only when empty: another run's entries stay


def _main() -> None:
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    lines = sys.stdin.buffer.read().decode(errors="replace").splitlines()  # blocks until EOF
    if "done" not in lines:
        _reap(lines)


if __name__ == "__main__":
    _main()
