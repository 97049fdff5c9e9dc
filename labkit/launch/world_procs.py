"""A World's processes: starting N ranks, reading their output, learning how one died, and
ending them all. :mod:`labkit.launch.world` decides *when*; this module knows *how*."""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from labkit.launch.config import LaunchConfig
from labkit.launch.launcher import _worker_env
from labkit.launch.lifeline import Lifeline
from labkit.launch.report import _stderr_tail
from labkit.launch.runs import LiveRun, new_run_dir, runs_root
from labkit.launch.world_rank import END_MARK, RANK_BOOTSTRAP
from labkit.launch.world_zygote import BOOTSTRAP as ZYGOTE_BOOTSTRAP
from labkit.launch.world_zygote import ForkedRank, read_status
from labkit.safe_files import open_private

# Fork the ranks from one zygote (Linux: /proc tells the zygote it is single-threaded), or start
# each as its own interpreter. benchmarks/bench_launch.py and the tests run both.
FORK_RANKS = sys.platform == "linux"


@dataclass
class _Ranks:
    """One incarnation of a world's processes and the threads that read their output."""

    run: Path
    lifeline: Lifeline  # the incarnation's process group; kills it when the caller dies
    procs: list[Any]  # subprocess.Popen, or world_zygote.ForkedRank (same names)
    conns: list[Connection]
    store: Any
    zygote: subprocess.Popen[bytes] | None = None  # the ranks' parent, where they are forked
    live: LiveRun | None = None  # the run folder is live (never pruned) until stop()
    # (rank, "out"/"err", a line of text, or None for the end mark of the call numbered last)
    lines: queue.Queue[tuple[int, str, str | None, int]] = field(default_factory=queue.Queue)
    tails: list[collections.deque[str]] = field(default_factory=list)
    pumps: list[threading.Thread] = field(default_factory=list)

    @classmethod
    def spawn(cls, cfg: LaunchConfig) -> _Ranks:
        """Start ``cfg.world_size`` ranks (they join the group on a TCPStore served here)."""
        import torch.distributed as dist

        run, live = new_run_dir(runs_root(), "world-")  # private to this user (runs.py)
        store = dist.TCPStore(cfg.host, 0, cfg.world_size, is_master=True, wait_for_workers=False)
        env = _worker_env(cfg, run.name, run)
        env["LABKIT_COLLECTIVE_TIMEOUT"] = str(cfg.collective_timeout)
        ranks = cls(run, Lifeline(env, run.name), [], [], store, live=live)
        try:
            ranks._start(cfg, env)
        except BaseException:
            holder: list[_Ranks | None] = [ranks]
            stop(holder)
            raise
        return ranks

    def _start(self, cfg: LaunchConfig, env: dict[str, str]) -> None:
        address = f"{cfg.host}:{self.store.port}"
        if FORK_RANKS:  # fork from one import of torch (world_zygote.py)
            self._fork_all(cfg, env, address)
            return
        for rank in range(cfg.world_size):  # elsewhere: one fresh interpreter per rank
            ours, theirs = socket.socketpair()
            argv = [str(theirs.fileno()), str(rank), str(cfg.world_size), str(cfg.backend)]
            proc = subprocess.Popen(
                [sys.executable, "-c", RANK_BOOTSTRAP, *argv, address, str(self.run)],
                pass_fds=(theirs.fileno(),),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                env=env,
                **self.lifeline.member(),  # the world's group: it dies with its caller
            )
            theirs.close()
            self.procs.append(proc)
            self._serve(rank, ours, proc.stdout, proc.stderr)

    def _fork_all(self, cfg: LaunchConfig, env: dict[str, str], address: str) -> None:
        """One zygote in the world's group forks every rank; ``self.procs`` are ForkedRanks."""
        theirs: list[int] = []  # per rank: socket, stdout and stderr write ends (the zygote's)
        ours: list[tuple[socket.socket, int, int]] = []
        status_r, status_w = os.pipe()
        try:
            for _ in range(cfg.world_size):
                mine, peer = socket.socketpair()
                (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
                theirs += [peer.detach(), out_w, err_w]
                ours.append((mine, out_r, err_r))
            argv = [str(status_w), str(cfg.world_size), str(cfg.backend), address, str(self.run)]
            self.zygote = subprocess.Popen(
                [sys.executable, "-c", ZYGOTE_BOOTSTRAP, *argv, *map(str, theirs)],
                pass_fds=(status_w, *theirs),
                stdout=subprocess.DEVNULL,
                stderr=theirs[2],  # rank 0's: a failed import reads as rank 0's traceback
                stdin=subprocess.DEVNULL,
                env=env,
                **self.lifeline.member(),  # the world's group: it dies with its caller
            )
        except BaseException:
            for fd in (status_r, *theirs, *(x for _, *pipes in ours for x in pipes)):
                os.close(fd)
            raise
        finally:
            os.close(status_w)
            for fd in theirs:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.procs = [ForkedRank(rank) for rank in range(cfg.world_size)]
        status = open(status_r, "rb")  # noqa: SIM115 - closed by read_status at its end
        args = (status, self.procs, self.zygote)
        threading.Thread(target=read_status, args=args, daemon=True).start()
        for rank, (mine, out_r, err_r) in enumerate(ours):  # the pumps close them at the end
            self._serve(rank, mine, open(out_r, "rb"), open(err_r, "rb"))  # noqa: SIM115

    def _serve(self, rank: int, ours: socket.socket, out: Any, err: Any) -> None:
        """Keep ``rank``'s end of its socket and pump its output."""
        self.conns.append(Connection(ours.detach()))
        self.tails.append(collections.deque(maxlen=200))
        for stream, tag in ((out, "out"), (err, "err")):
            self.pumps.append(
                threading.Thread(target=_pump, args=(stream, rank, tag, self), daemon=True)
            )
            self.pumps[-1].start()

    def death(self, rank: int) -> dict[str, Any]:
        """How ``rank`` died (its socket closed): exit code, signal, the tail of its stderr."""
        proc = self.procs[rank]
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=2)
        time.sleep(0.05)  # let the pump read the last of its stderr
        code = proc.returncode
        # A rank the zygote never forked: the zygote died first, and its stderr is rank 0's.
        unborn = isinstance(proc, ForkedRank) and not proc.forked
        tail = _stderr_tail("".join(self.tails[0 if unborn else rank]), entry="_run_job")
        if unborn:
            tail = f"the world's zygote exited with code {code} before forking it:\n{tail}"
        return {
            "rank": rank,
            "exitcode": code,
            "signal": signal.Signals(-code).name if code is not None and code < 0 else "",
            "stderr": tail,
        }

    def how(self, rank: int) -> str:
        """A dead rank's end in words: "killed by SIGKILL", "exit code 1"."""
        code = self.procs[rank].returncode
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"

    def print(self, ends: set[tuple[int, str, int]], quiet: bool, block: float) -> None:
        """Print the lines waiting as ``[rankN]: ...``; record end marks in ``ends``."""
        # Printing from the caller's thread keeps the output in the running cell.
        try:
            item = self.lines.get(timeout=block) if block else self.lines.get_nowait()
        except queue.Empty:
            return
        while True:
            rank, tag, text, call = item
            if text is None:
                ends.add((rank, tag, call))
            elif not quiet:
                (sys.stdout if tag == "out" else sys.stderr).write(f"[rank{rank}]: {text}")
            try:
                item = self.lines.get_nowait()
            except queue.Empty:
                break
        sys.stdout.flush()
        sys.stderr.flush()

    def finish_output(
        self,
        ends: set[tuple[int, str, int]],
        replies: dict[int, Any],
        quiet: bool,
        call: int,
    ) -> None:
        """Print until every replying rank's end marks arrived: a call's lines before its result."""
        want = {(r, tag, call) for r in replies for tag in ("out", "err")}
        deadline = time.monotonic() + 1.0
        while not want <= ends and time.monotonic() < deadline:
            self.print(ends, quiet, block=0.01)
        self.print(ends, quiet, block=0.0)


def _pump(stream: Any, rank: int, tag: str, ranks: _Ranks) -> None:
    """Forward a rank's lines; an end-of-call mark becomes ``(rank, tag, None, call)``."""
    with open_private(ranks.run / f"rank{rank}.std{tag}.log", "ab") as log:
        for raw in iter(stream.readline, b""):
            log.write(raw)
            line = raw.decode(errors="replace")
            text, mark, call = line.partition(END_MARK)
            if text:
                ranks.lines.put((rank, tag, text if text.endswith("\n") else text + "\n", 0))
                if tag == "err":
                    ranks.tails[rank].append(text)
            if mark:
                ranks.lines.put((rank, tag, None, int(call)))
    stream.close()


def stop(holder: list[_Ranks | None]) -> None:
    """Kill every process of the incarnation in ``holder`` (ranks and whatever they started)
    and reap them; close its pipes. Returns in milliseconds: once no process holds the output
    pipes, the readers see their end at once."""
    ranks = holder[0]
    holder[0] = None
    if ranks is None:
        return
    if ranks.zygote is not None:  # the ranks' parent, our child: its pid cannot be reused
        roots = [ranks.zygote.pid] if ranks.zygote.poll() is None else []
    else:
        roots = [p.pid for p in ranks.procs if p.returncode is None]
    ranks.lifeline.end(roots=roots)
    for proc in [*ranks.procs, *([ranks.zygote] if ranks.zygote else [])]:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    for conn in ranks.conns:
        conn.close()
    deadline = time.monotonic() + 2.0
    for t in ranks.pumps:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    if ranks.live is not None:
        ranks.live.release()  # finished: prunable from now on
