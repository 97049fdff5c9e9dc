"""Every process of a job dies with the process that started it, on every way out.

The process trees (``*``: started by the caller, into the job's group)::

    launch:  caller -> lifeline*, agent* -> resource tracker, forkserver -> ranks -> children
    World:   caller -> lifeline*, rank*  -> children (a subprocess.Popen in a cell)

Why ``PR_SET_PDEATHSIG`` alone cannot promise it. It ties a process to its *parent*, and only
from the moment the child asks (a parent that died earlier is missed unless ``getppid`` is
checked). A launch's ranks are children of the forkserver, which waits for every rank to exit
(each holds its "alive" pipe), and the resource tracker waits for all of them: after a
SIGKILL of the caller they waited on one another forever. A process a rank starts has no
death signal at all. And a death signal follows the *thread* that started the process.

What holds instead, in three layers:

1. **One process group per job.** The lifeline starts first, as the leader of a new group; every
   other top process of the job is started into that group (:meth:`Lifeline.member`), and
   whatever they start inherits it: forkserver, resource tracker, ranks, a rank's children.
   ``killpg(group, SIGKILL)`` ends them all at once, with no parent-child order to race.
2. **The lifeline is a watchdog**: this file run as ``python -I -S lifeline.py FD`` (no torch,
   no site: it starts in milliseconds, alongside the job, so launch latency is unchanged). It
   blocks reading a pipe whose only write end the caller holds (non-inheritable; ``Popen``
   closes other fds). When the caller dies, SIGKILL included, the kernel closes that end, the
   read returns EOF, and the watchdog kills every process carrying the job's run id
   (``LABKIT_RUN_ID``, inherited by all: one that left the group with ``setsid`` too), then
   the group, itself last. EOF is a state, not an event: a caller that died before the
   watchdog's first read is seen just the same, so there is no startup race.
3. **The caller's own ways out** (success, failure, timeout, interrupt, ``close``, garbage
   collection) call :meth:`Lifeline.end`: collect the roots' descendants, the group and the
   run id's carriers, kill them all, reap, and return once each is dead.

Limits: a process that both leaves the group and clears its environment is found only while
its parent lives (layer 3); a child the caller *forks* without exec inherits the pipe's write
end, and the job then lives as long as that child.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from typing import Any

RUN_ID_VAR = "LABKIT_RUN_ID"  # in the environment of every process of a job


class Lifeline:
    """A job's process group and the watchdog that kills the job when the caller dies."""

    def __init__(self, env: dict[str, str], run_id: str):
        self.run_id = run_id
        read, self._write = os.pipe()  # both ends non-inheritable (PEP 446)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), str(read)],
                pass_fds=(read,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={**env, RUN_ID_VAR: run_id},  # the job's: a test's tag marks it too
                **_group_kwargs(0),  # a new group, led by the watchdog
            )
        except BaseException:
            os.close(self._write)
            raise
        finally:
            os.close(read)
        self.group = self.proc.pid
        self._ended = False

    def member(self) -> dict[str, Any]:
        """``Popen`` keyword arguments that start a process in the job's group.

        The group lives in the caller's session but is not the terminal's foreground group:
        a terminal's Ctrl-C reaches the caller only, which decides what dies."""
        return _group_kwargs(self.group)

    def end(self, roots: Iterable[int] = ()) -> None:
        """Kill every process of the job and return once each is dead (idempotent).

        The job: the ``roots`` (its top processes, children of the caller not yet reaped, so
        their pids cannot have been reused) and their descendants, the group's members and
        every process carrying the run id. Descendants are collected before anything is
        killed: once their parent is gone they can no longer be found that way."""
        import psutil

        if self._ended:
            return
        self._ended = True
        victims: dict[int, psutil.Process] = {}
        for pid in roots:
            with contextlib.suppress(psutil.Error):
                top = psutil.Process(pid)
                victims.update((p.pid, p) for p in [top, *top.children(recursive=True)])
        for pid in job_pids(self.run_id, self.group):
            with contextlib.suppress(psutil.Error):
                victims.setdefault(pid, psutil.Process(pid))
        # The watchdog is our child and not reaped yet: the group's id cannot be reused.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.group, signal.SIGKILL)
        for p in victims.values():
            with contextlib.suppress(psutil.Error):
                p.kill()  # psutil refuses a pid reused since it was collected
        os.close(self._write)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        alive = list(victims.values())
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if _running(p)]
            if alive:
                time.sleep(0.005)


def job_pids(run_id: str, group: int | None = None) -> list[int]:
    """Every process (but this one) whose environment carries ``run_id``, or in ``group``.

    Reads ``/proc`` (nothing on a system without it); a process of another user whose
    environment cannot be read counts only through its group."""
    mark = f"\0{RUN_ID_VAR}={run_id}\0".encode()
    found = []
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if group is not None and os.getpgid(int(name)) == group:
                    found.append(int(name))
                    continue
                with open(f"/proc/{name}/environ", "rb") as f:
                    if mark in b"\0" + f.read() + b"\0":
                        found.append(int(name))
    return found


def _running(p: Any) -> bool:
    """Alive and not a zombie (a zombie awaiting its reaper holds nothing)."""
    import psutil

    try:
        return bool(p.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def _group_kwargs(group: int) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        return {"process_group": group}
    # Python 3.10 has no process_group=; setpgid is one system call in the child.
    return {"preexec_fn": lambda: os.setpgid(0, group)}  # pragma: no cover


def _watch(fd: int) -> None:
    """The watchdog: block until the caller's end of the pipe closes, then end the job."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a stray Ctrl-C is the caller's to handle
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # kill the job on the way out
    try:
        while os.read(fd, 64):
            pass
    finally:
        run_id = os.environ.get(RUN_ID_VAR, "")
        for _ in range(2):  # twice: a process may start another while we look
            for pid in job_pids(run_id) if run_id else []:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        os.killpg(0, signal.SIGKILL)


if __name__ == "__main__":
    _watch(int(sys.argv[1]))
