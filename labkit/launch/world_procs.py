"""A World's processes: starting N ranks, reading their output, learning how one died, and
ending them all. :mod:`labkit.launch.world` decides *when*; this module knows *how*."""

from __future__ import annotations

import collections
import contextlib
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from labkit.launch.config import _ENV_RUN_ID, LaunchConfig
from labkit.launch.launcher import _runs_root, _worker_env
from labkit.launch.report import _stderr_tail
from labkit.launch.world_rank import END_MARK

_BOOTSTRAP = (
    "import sys; from labkit.launch.world_rank import rank_main; "
    "rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:])"
)


@dataclass
class _Ranks:
    """One incarnation of a world's processes and the threads that read their output."""

    run: Path
    procs: list[subprocess.Popen[bytes]]
    conns: list[Connection]
    store: Any
    # (rank, "out"/"err", a line of text, or None for the end mark of the call numbered last)
    lines: queue.Queue[tuple[int, str, str | None, int]] = field(default_factory=queue.Queue)
    tails: list[collections.deque[str]] = field(default_factory=list)
    pumps: list[threading.Thread] = field(default_factory=list)

    @classmethod
    def spawn(cls, cfg: LaunchConfig) -> _Ranks:
        """Start ``cfg.world_size`` ranks (they join the group on a TCPStore served here)."""
        import torch.distributed as dist

        root = _runs_root()
        root.mkdir(parents=True, exist_ok=True)
        prefix = time.strftime("world-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6] + "-"
        run = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
        store = dist.TCPStore(cfg.host, 0, cfg.world_size, is_master=True, wait_for_workers=False)
        env = _worker_env(cfg, run.name)
        env["LABKIT_COLLECTIVE_TIMEOUT"] = str(cfg.collective_timeout)
        ranks = cls(run, [], [], store)
        for rank in range(cfg.world_size):
            ours, theirs = socket.socketpair()
            argv = [str(theirs.fileno()), str(rank), str(cfg.world_size), str(cfg.backend)]
            argv += [f"{cfg.host}:{store.port}", str(run)]
            ranks.procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _BOOTSTRAP, *argv],
                    pass_fds=(theirs.fileno(),),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,  # a terminal's Ctrl-C reaches us; we decide
                )
            )
            theirs.close()
            ranks.conns.append(Connection(ours.detach()))
            ranks.tails.append(collections.deque(maxlen=200))
            for stream, tag in ((ranks.procs[-1].stdout, "out"), (ranks.procs[-1].stderr, "err")):
                ranks.pumps.append(
                    threading.Thread(target=_pump, args=(stream, rank, tag, ranks), daemon=True)
                )
                ranks.pumps[-1].start()
        return ranks

    def death(self, rank: int) -> dict[str, Any]:
        """How ``rank`` died (its socket closed): exit code, signal, the tail of its stderr."""
        proc = self.procs[rank]
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=2)
        time.sleep(0.05)  # let the pump read the last of its stderr
        code = proc.returncode
        return {
            "rank": rank,
            "exitcode": code,
            "signal": signal.Signals(-code).name if code is not None and code < 0 else "",
            "stderr": _stderr_tail("".join(self.tails[rank]), entry="_run_job"),
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
    with open(ranks.run / f"rank{rank}.std{tag}.log", "ab") as log:
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
    """SIGKILL every rank of the incarnation in ``holder`` and reap it; close its pipes."""
    import psutil

    ranks = holder[0]
    holder[0] = None
    if ranks is None:
        return
    victims = []
    for proc in ranks.procs:
        with contextlib.suppress(psutil.Error):
            victims += psutil.Process(proc.pid).children(recursive=True)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    for p in victims:
        with contextlib.suppress(psutil.Error):
            if p.environ().get(_ENV_RUN_ID) == ranks.run.name:  # never a recycled pid
                p.kill()
    for proc in ranks.procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    for conn in ranks.conns:
        conn.close()
    for t in ranks.pumps:
        t.join(timeout=2)
