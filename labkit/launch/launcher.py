"""The caller's side of a launch: ship the job, stream output, watch the deadline, reap, report.

What travels to the ranks (the pickled job, their environment) is in ``shipping.py``; blame
and stacks in ``report.py``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle

from labkit.launch.config import (
    _JOB_FILE,
    JobTimeoutError,
    LaunchConfig,
    LaunchError,
)
from labkit.launch.lifeline import Lifeline, _running
from labkit.launch.report import _dump_stacks, _error_records, _final_failure, _root_cause
from labkit.launch.runs import new_run_dir, prune_old_runs, runs_root
from labkit.launch.shipping import _dumps, _worker_env
from labkit.safe_files import write_private

# The agent's first act, while it is single-threaded: import torch once and fork the
# forkserver the ranks will fork from (zygote.py), instead of a second interpreter importing it.
_AGENT_BOOTSTRAP = """\
import sys
if sys.argv[3] == "forkserver":
    from labkit.launch.zygote import start_forkserver_here
    start_forkserver_here(["labkit.launch.rank"])
from labkit.launch.agent import _agent_main
sys.exit(_agent_main(sys.argv[1], int(sys.argv[2])))
"""
_RANK_PREFIX = re.compile(r"^\[rank(\d+)\]: ")


def _any_alive(run: Path, ranks: set[int]) -> bool:
    import psutil

    for rank in ranks:
        with contextlib.suppress(ValueError, OSError, psutil.Error):
            if _running(psutil.Process(int((run / f"pid.{rank}").read_text()))):
                return True
    return False


def _finished(run: Path, world_size: int) -> set[int]:
    """Ranks whose result is on disk: they completed ``fn`` and are never to blame."""
    return {rank for rank in range(world_size) if (run / f"result.{rank}.pkl").exists()}


def _pump(stream: Any, tag: str, lines: queue.Queue[tuple[str, str]]) -> None:
    for raw in iter(stream.readline, b""):
        lines.put((tag, raw.decode(errors="replace")))
    stream.close()


class _Job:
    """One launch in flight: the agent subprocess, its output, and the files its ranks write
    in ``run`` (results, error records, pids). ``watch`` is the loop; the rest serves it."""

    def __init__(self, cfg: LaunchConfig, run: Path):
        self.cfg = cfg
        self.run = run
        env = _worker_env(cfg, run.name, run)
        self.lifeline = Lifeline(env, run.name)  # first: the job's group and its watchdog
        try:
            self.proc = self._start_agent(env)
        except BaseException:
            self.lifeline.end()
            raise
        self.lines: queue.Queue[tuple[str, str]] = queue.Queue()
        self.pumps = [
            threading.Thread(target=_pump, args=(self.proc.stdout, "out", self.lines), daemon=True),
            threading.Thread(target=_pump, args=(self.proc.stderr, "err", self.lines), daemon=True),
        ]
        for t in self.pumps:
            t.start()
        self.agent_noise: list[str] = []
        self.echoed: dict[tuple[int, str], int] = {}  # (rank, "out"/"err") -> lines shown
        self.first_failure: float | None = None
        self.silent_dead: set[int] = set()

    def _start_agent(self, env: dict[str, str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-c", _AGENT_BOOTSTRAP]
            + [str(self.run), str(os.getpid()), str(self.cfg.start_method)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
            **self.lifeline.member(),  # in the job's group: it and all it starts die together
        )

    def watch(self) -> None:
        """Print output until every rank's result is on disk, a failure is final, or the
        deadline passes (``JobTimeoutError`` with every rank's stack)."""
        deadline = time.monotonic() + self.cfg.timeout
        while self.proc.poll() is None:
            self.drain(0.05)
            if time.monotonic() > deadline:
                raise JobTimeoutError(
                    self.cfg.timeout, _dump_stacks(self.run, self.cfg.world_size), self.run / "logs"
                )
            if self.failure_settled():
                return
            # Done once every rank's result is on disk: the agent's own shutdown (exit
            # barrier, log tailers, interpreter exit) adds seconds and nothing we need.
            if (
                not self.cfg.max_restarts
                and len(_finished(self.run, self.cfg.world_size)) == self.cfg.world_size
            ):
                return

    def failure_settled(self) -> bool:
        """Fail fast: True once a rank has failed for good and the culprit has had its say.

        After a collateral error ("connection closed by peer") the culprit may still be busy
        in its own teardown: wait while a rank that has not reported is alive, up to a cap.
        """
        records = _error_records(self.run)
        if not (records and _final_failure(records, self.cfg.max_restarts)):
            return False
        self.first_failure = self.first_failure or time.monotonic()
        if any(not r["collateral"] for r in records):  # pending ones count here
            return True
        waited = time.monotonic() - self.first_failure
        if waited > 10.0:
            return True
        reported = {r["rank"] for r in records} | _finished(self.run, self.cfg.world_size)
        silent = set(range(self.cfg.world_size)) - reported
        if _any_alive(self.run, silent):
            return False
        # Someone vanished without a word (SIGKILL, OOM, a native abort): let the agent record
        # how it died, so the message can name the signal and blame that rank, not rank 0 of
        # the silent ones. The agent writes its record once it has stopped the other ranks,
        # which took over 3 s on 2 cores at a load of 15: wait for the record or the agent's
        # exit, up to the cap above.
        self.silent_dead = silent
        return (self.run / "agent_failures.json").exists() or self.proc.poll() is not None

    def drain(self, block_for: float) -> None:
        # Printing from this (the caller's) thread keeps output in the running cell.
        try:
            tag, line = self.lines.get(timeout=block_for)
        except queue.Empty:
            return
        while True:
            if m := _RANK_PREFIX.match(line):
                self.echoed[int(m[1]), tag] = self.echoed.get((int(m[1]), tag), 0) + 1
                if not self.cfg.quiet:
                    (sys.stdout if tag == "out" else sys.stderr).write(line)
            else:
                self.agent_noise.append(line)
            try:
                tag, line = self.lines.get_nowait()
            except queue.Empty:
                break
        sys.stdout.flush()
        sys.stderr.flush()

    def catch_up(self) -> None:
        # The job may be reaped before the agent's tee shows the last lines: print what the
        # rank logs hold beyond what was echoed. (Restarts make the counts ambiguous: skip.)
        attempts = sorted(self.run.glob("logs/*/attempt_*"))
        if self.cfg.quiet or self.cfg.max_restarts or not attempts:
            return
        for rank in range(self.cfg.world_size):
            for tag, stream in (("out", sys.stdout), ("err", sys.stderr)):
                path = attempts[-1] / str(rank) / f"std{tag}.log"
                if path.exists():
                    lines = path.read_text(errors="replace").splitlines(keepends=True)
                    for line in lines[self.echoed.get((rank, tag), 0) :]:
                        stream.write(f"[rank{rank}]: {line}")
                stream.flush()

    def stop(self) -> None:
        """Every way out (done, failed, timed out, interrupted) ends the whole job here; this
        also reaps ranks of an agent that exited on its own, and whatever a rank started."""
        self.lifeline.end(roots=[self.proc.pid] if self.proc.returncode is None else [])
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        for t in self.pumps:
            t.join(timeout=2)
        self.drain(0)
        self.catch_up()

    def results(self) -> list[Any]:
        """The per-rank results, or the error that explains why there are none."""
        run, world_size = self.run, self.cfg.world_size
        done = len(_finished(run, world_size)) == world_size
        if self.first_failure is not None or (self.proc.returncode != 0 and not done):
            failure = _root_cause(run, run / "logs", self.silent_dead)
            if failure is not None:
                raise failure
            agent_error = run / "agent_error.txt"
            detail = (
                agent_error.read_text() if agent_error.exists() else "".join(self.agent_noise[-40:])
            )
            raise LaunchError(
                f"the job failed before any rank reported an error:\n{detail}", run / "logs"
            )
        results = []
        for rank in range(world_size):
            with open(run / f"result.{rank}.pkl", "rb") as f:
                results.append(cloudpickle.load(f))
        return results


def launch(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    backend: str | None = None,
    timeout: float = 300.0,
    **options: Any,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks; return ``[result of rank 0, rank 1, ...]``.

    ``fn`` may be defined in a notebook cell, with its helpers and classes: it travels by
    value (cloudpickle). Each rank's output streams into the caller, prefixed ``[rankN]:``.
    Other keyword options are fields of :class:`LaunchConfig` (``max_restarts``,
    ``start_method``, ``threads_per_rank``, ``host``, ``log_dir``, ``env``, ``quiet``,
    ``cluster``: an :class:`labkit.cluster.EmulatedCluster` whose nodes the ranks run on).

    Raises :class:`RankFailedError` when a rank raises, :class:`JobTimeoutError` when the job
    outlives ``timeout`` seconds, ``KeyboardInterrupt`` when interrupted (all ranks killed).
    """
    if not callable(fn):
        raise TypeError(
            f"launch() needs a callable as its first argument, got {type(fn).__name__}: {fn!r}"
        )
    cfg = LaunchConfig(world_size=world_size, backend=backend, timeout=timeout, **options)

    root = runs_root(cfg.log_dir)  # private to this user, checked (see runs.py)
    prune_old_runs(root)
    run, live = new_run_dir(root)  # held (never pruned) until the job ends
    with contextlib.ExitStack() as network:
        network.callback(live.release)  # last: the results are read before the run is prunable
        # An emulated cluster's network exists for the job's life only (see labkit.cluster).
        cluster = None
        if cfg.cluster is not None:
            from labkit.cluster.run import cluster_network

            cluster = network.enter_context(cluster_network(cfg.cluster, cfg.world_size))
        try:
            payload = _dumps({"fn": fn, "args": args, "config": cfg, "cluster": cluster})
        except Exception as exc:
            raise TypeError(
                f"cannot send fn and args to the ranks (pickling failed): {exc}"
            ) from exc
        write_private(run / _JOB_FILE, payload)

        job = _Job(cfg, run)
        try:
            job.watch()
        finally:
            job.stop()
        return job.results()
