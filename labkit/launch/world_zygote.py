"""A World's ranks forked from one interpreter that imported torch once (Linux).

Why: each rank of a ``World`` used to be a fresh ``python -c`` that imported torch, about 2 s
of CPU each, so ``World(4)`` paid four imports before its first call. Here one process, the
zygote, imports the ranks' module (torch with it) while single-threaded and forks the N ranks;
each rank is then exactly what the fresh interpreter was after its imports.

How (the caller's side is ``world_procs.py``)::

    caller                                   zygote (python -c, in the world's process group)
    socketpair + stdout/stderr pipe per rank -> imports labkit.launch.world_rank (torch)
    status pipe  <--- "fork R PID" ----------   fork rank R: its pipes onto fds 1 and 2,
                                                every other passed fd closed, rank_main(...)
                 <--- "exit R CODE" ---------   reaps each rank, reports its exit
                                                (CODE as subprocess's returncode: -9 = SIGKILL)

The zygote's own stderr is rank 0's, so a failed import reads as rank 0's traceback. It exits
when its last rank has. A rank is a :class:`ForkedRank`: ``pid``, ``poll``, ``wait`` and
``returncode`` as a ``subprocess.Popen`` has them, fed by the status pipe. If the zygote dies
first (killed with the world's group), ranks it never reported take its exit code.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import traceback
from typing import Any

__all__ = ["ForkedRank", "read_status", "zygote_main"]

BOOTSTRAP = "import sys; from labkit.launch.world_zygote import zygote_main; zygote_main(sys.argv)"


def zygote_main(argv: list[str]) -> None:
    """``argv``: [-c, status_fd, world_size, backend, store, run_dir, then per rank its socket,
    stdout and stderr fds]."""
    status, world_size = int(argv[1]), int(argv[2])
    backend, store, run_dir = argv[3], argv[4], argv[5]
    fds = [int(x) for x in argv[6:]]
    per_rank = [fds[3 * r : 3 * r + 3] for r in range(world_size)]  # (socket, out, err)
    import torch

    from labkit.launch.world_rank import RANK_BOOTSTRAP, rank_main  # torch: what ranks share

    # Forking a process with other threads alive can copy a lock one of them held, and CUDA
    # set up before a fork is unusable after it (NCCL ranks); then each rank execs a fresh
    # interpreter instead (the import is paid per rank again, nothing else changes).
    unsafe = len(os.listdir("/proc/self/task")) > 1 or torch.cuda.is_initialized()
    ranks: dict[int, int] = {}  # pid -> rank
    for rank, (sock, out, err) in enumerate(per_rank):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.dup2(out, 1)
                os.dup2(err, 2)
                for fd in (status, *fds):
                    if fd != sock:
                        os.close(fd)
                if unsafe:
                    args = [str(sock), str(rank), str(world_size), backend, store, run_dir]
                    os.execv(sys.executable, [sys.executable, "-c", RANK_BOOTSTRAP, *args])
                rank_main(sock, rank, world_size, backend, store, run_dir)
                code = 0  # rank_main returns only after reporting a failed join
            except BaseException:  # noqa: BLE001 - the rank's stderr is the caller's to read
                traceback.print_exc()
            finally:
                for stream in (sys.stdout, sys.stderr):
                    stream.flush()
                os._exit(code)
        ranks[pid] = rank
        os.write(status, f"fork {rank} {pid}\n".encode())
    for fd in fds:
        os.close(fd)
    while ranks:
        pid, how = os.wait()
        if pid in ranks:
            code = os.waitstatus_to_exitcode(how)
            os.write(status, f"exit {ranks.pop(pid)} {code}\n".encode())
    os._exit(0)


class ForkedRank:
    """One forked rank as the caller sees it, with ``subprocess.Popen``'s names."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.returncode: int | None = None
        self._pid: int | None = None
        self._forked = threading.Event()
        self._ended = threading.Event()

    @property
    def pid(self) -> int:
        """The rank's process id (waits up to 30 s for the zygote to report the fork)."""
        if not self._forked.wait(30) or self._pid is None:
            raise ProcessLookupError(f"rank {self.rank} was never forked")
        return self._pid

    @property
    def forked(self) -> bool:
        """Whether the zygote reported this rank's fork (after waiting for its fate)."""
        return self._pid is not None

    def poll(self) -> int | None:
        if self.returncode is None and self._pid is not None:
            try:
                os.kill(self._pid, 0)
            except ProcessLookupError:  # reaped by the zygote: its exit line is on the way
                self._ended.wait(1.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"rank {self.rank}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def _set_pid(self, pid: int) -> None:
        self._pid = pid
        self._forked.set()

    def _set_exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._forked.set()  # a rank never forked has no pid; ``pid`` says so
        self._ended.set()


def read_status(stream: Any, ranks: list[ForkedRank], zygote: subprocess.Popen[bytes]) -> None:
    """Apply the zygote's status lines to ``ranks`` until it exits (a thread's target). Ranks
    without an exit line then take the zygote's own exit code."""
    for raw in iter(stream.readline, b""):
        kind, rank, value = raw.split()
        target = ranks[int(rank)]
        if kind == b"fork":
            target._set_pid(int(value))
        else:
            target._set_exit(int(value))
    stream.close()
    with contextlib.suppress(subprocess.TimeoutExpired):  # the pipe closed: it is exiting
        zygote.wait(timeout=10)
    code = zygote.returncode if zygote.returncode is not None else -9
    for r in ranks:
        r._set_exit(code)
