"""A live world: N ranks that start once and serve calls until closed.

``launch`` starts N processes a job (seconds). A ``World`` pays that once; then ``run(fn,
*args)`` costs milliseconds, and ``%%ranks`` cells run on every rank, state kept between::

    world = labkit.World(2)                  # ranks start, the process group is initialised
    world.run(fn, 3)                         # -> [rank 0's result, rank 1's result]
    %%ranks                                  # (a cell) runs on every rank; `t` stays there
    t = torch.full((2,), float(rank))

How it is built::

    caller (kernel)                           rank r (forked: world_zygote.py; world_rank.py)
    TCPStore server on a free port  <--------------------  joins the default group once
    socketpair per rank:  {"kind": "run", payload} ------>  _run_job(fn, *args)
    print "[rankN]: ..." <---- stdout/stderr pipes <-----  output, then an end-of-call mark
    result / error record <----------------------------  reply

``world_procs.py`` starts, reads and ends the processes, forked from one import of torch
(``world_zygote.py``); ``world_rank.py`` is the ranks' side.

The guarantees are launch's. A rank that raises fails the call with its traceback; the world
stays usable when every rank got back to its loop, and is otherwise stopped. A call that
outlives its timeout gives every rank's stack and stops the world; an interrupt stops the
ranks' code (or, when a rank does not stop, the world). A stopped or crashed world (a killed
rank) restarts on the next call, saying so. The ranks, and every process they start, are one
process group that dies with the caller, SIGKILL included (the lifeline, ``lifeline.py``), and
with the world (``close``, garbage collection, interpreter exit), in milliseconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any, ClassVar

import cloudpickle

from labkit.launch.config import JobTimeoutError, LaunchConfig, LaunchError
from labkit.launch.launcher import _dumps
from labkit.launch.report import _blame, _dump_stacks
from labkit.launch.world_procs import _Ranks, stop

_GRACE_S = 2.0  # after one rank fails or an interrupt, how long the others get to come back


class WorldClosedError(LaunchError):
    """The world was closed; create a new one."""


class World:
    """``world_size`` ranks that stay alive across calls. See the module docstring.

    The latest world created is :meth:`latest` (the default world of ``%%ranks``).
    """

    _latest: ClassVar[weakref.ref[World] | None] = None

    def __init__(
        self,
        world_size: int = 2,
        backend: str | None = None,
        timeout: float = 300.0,
        *,
        quiet: bool = False,
        threads_per_rank: int | None = None,
        env: dict[str, str] | None = None,
    ):
        self.cfg = LaunchConfig(
            world_size=world_size,
            backend=backend,
            timeout=timeout,
            quiet=quiet,
            threads_per_rank=threads_per_rank,
            env=dict(env or {}),
        )
        self.restarts = 0  # how many times a broken world was replaced
        self._holder: list[_Ranks | None] = [None]
        self._closed = False
        self._broken: str | None = None
        self._calls = 0
        self._finalizer = weakref.finalize(self, stop, self._holder)
        self._start()
        World._latest = weakref.ref(self)

    @classmethod
    def latest(cls) -> World | None:
        """The most recently created world, while something else still holds it."""
        return cls._latest() if cls._latest is not None else None

    # ---- life --------------------------------------------------------------------------

    def _start(self) -> None:
        ranks = _Ranks.spawn(self.cfg)
        self._holder[0] = ranks
        self._gather(ranks, 0, max(120.0, self.cfg.timeout), quiet=self.cfg.quiet)

    def _ensure(self) -> _Ranks:
        """The live incarnation: raise if closed, restart if broken or a rank has died."""
        if self._closed:
            raise WorldClosedError(
                f"this World({self.cfg.world_size}) was closed; start a new one with "
                f"labkit.World({self.cfg.world_size})"
            )
        ranks = self._holder[0]
        if ranks is not None:
            dead = [r for r, p in enumerate(ranks.procs) if p.poll() is not None]
            if dead:
                self._break(f"rank {dead[0]} died between calls ({ranks.how(dead[0])})")
        if self._holder[0] is None:
            print(
                f"labkit.World: restarting {self.cfg.world_size} ranks: {self._broken}",
                file=sys.stderr,
            )
            self.restarts += 1
            self._start()
        ranks = self._holder[0]
        assert ranks is not None
        return ranks

    def _break(self, reason: str) -> None:
        self._broken = reason
        stop(self._holder)

    def close(self) -> None:
        """End every rank, and whatever the ranks started, now. Calling the world afterwards
        raises :class:`WorldClosedError`.

        The whole process group is killed at once (no polite "close" to the ranks first: a
        rank that exits before its children are collected orphans them, and they keep the
        output pipes open)."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self._holder[0] is None else "alive"
        return f"World({self.cfg.world_size}, backend={self.cfg.backend!r}, {state})"

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids (empty when closed or broken)."""
        ranks = self._holder[0]
        return [p.pid for p in ranks.procs] if ranks is not None else []

    # ---- calls -------------------------------------------------------------------------

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float | None = None,
        quiet: bool | None = None,
        isolate: bool = False,
    ) -> list[Any]:
        """``fn(*args)`` on every rank; returns ``[rank 0's result, rank 1's, ...]``.

        ``isolate=True`` (the test suite's mode) starts the call barrier-synchronised with a
        fresh process's defaults (torch seed, grad mode, default dtype) and removes the
        subgroups, environment and working-directory changes it made.
        """
        if not callable(fn):
            raise TypeError(f"World.run() needs a callable, got {type(fn).__name__}: {fn!r}")
        try:
            payload = _dumps({"fn": fn, "args": args})
        except Exception as exc:
            raise TypeError(
                f"cannot send fn and args to the ranks (pickling failed): {exc}"
            ) from exc
        msg = {"kind": "run", "payload": payload, "isolate": isolate}
        return self._call(msg, timeout, quiet)

    def exec(self, source: str, timeout: float | None = None) -> list[Any]:
        """Run ``source`` on every rank in its persistent namespace (which starts with
        ``torch``, ``dist``, ``rank``, ``world_size``); returns each rank's value of the last
        line when it is an expression, else ``None``. The body of a ``%%ranks`` cell."""
        filename = f"<ranks-cell-{self._calls + 1}>"
        msg = {"kind": "exec", "source": source, "filename": filename, "isolate": False}
        return self._call(msg, timeout, None)

    def _call(self, msg: dict[str, Any], timeout: float | None, quiet: bool | None) -> list[Any]:
        limit = float(timeout if timeout is not None else self.cfg.timeout)
        if not limit > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        ranks = self._ensure()
        self._calls += 1
        msg["call"] = self._calls
        for conn in ranks.conns:
            with contextlib.suppress(OSError):  # a dead rank shows up as EOF in _gather
                conn.send(msg)
        return self._gather(
            ranks, self._calls, limit, quiet=self.cfg.quiet if quiet is None else quiet
        )

    def _gather(self, ranks: _Ranks, call: int, limit: float, quiet: bool) -> list[Any]:
        """Wait for every rank's reply to ``call`` while printing their output; then results
        or the error to blame. Call 0 is the ranks' start (their ``ready``)."""
        n = self.cfg.world_size
        replies: dict[int, dict[str, Any]] = {}
        died: list[dict[str, Any]] = []
        ends: set[tuple[int, str, int]] = set()
        deadline = time.monotonic() + limit
        first_failure: float | None = None
        try:
            while len(replies) + len(died) < n:
                ranks.print(ends, quiet, block=0.0)
                waiting = {ranks.conns[r]: r for r in range(n) if r not in replies}
                waiting = {c: r for c, r in waiting.items() if r not in {d["rank"] for d in died}}
                for ready in wait(list(waiting), timeout=0.02):
                    rank = waiting[ready]  # type: ignore[index]
                    try:
                        replies[rank] = ranks.conns[rank].recv()
                    except (EOFError, OSError):
                        died.append(ranks.death(rank))
                    if not replies.get(rank, {"ok": False})["ok"]:
                        first_failure = first_failure or time.monotonic()
                now = time.monotonic()
                if first_failure is not None and now - first_failure > _GRACE_S:
                    break  # the others are stuck (in a collective with the failed rank)
                if now > deadline:
                    self._timeout(ranks, limit)
        except KeyboardInterrupt:
            self._interrupt(ranks, replies, call)
            raise
        if call:
            ranks.finish_output(ends, replies, quiet, call)
        return self._outcome(ranks, replies, died)

    def _outcome(
        self, ranks: _Ranks, replies: dict[int, dict[str, Any]], died: list[dict[str, Any]]
    ) -> list[Any]:
        n = self.cfg.world_size
        records = [r["error"] for r in replies.values() if not r["ok"]]
        if not records and not died and len(replies) == n:
            if all(r.get("group_intact", True) for r in replies.values()):
                return [
                    cloudpickle.loads(replies[r]["value"])
                    for r in range(n)
                    if "value" in replies[r]
                ]
            self._break("the last call destroyed the default process group")
            return [cloudpickle.loads(replies[r]["value"]) for r in range(n)]
        stuck = sorted(set(range(n)) - set(replies) - {d["rank"] for d in died})
        if died or stuck or any(r["collateral"] for r in records):
            what = f"rank {died[0]['rank']} died" if died else f"ranks {stuck} were stuck"
            self._break(f"the last call failed and {what}" if stuck or died else "a peer was lost")
        failure = _blame(records, died, ranks.run)
        assert failure is not None
        raise failure

    def _timeout(self, ranks: _Ranks, limit: float) -> None:
        for rank in range(self.cfg.world_size):
            with contextlib.suppress(OSError):
                os.truncate(ranks.run / f"stack.{rank}.txt", 0)  # ranks append: only this dump
        stacks = _dump_stacks(ranks.run, self.cfg.world_size, entry="_run_job")
        self._break(f"the last call ran past timeout={limit:g}s")
        raise JobTimeoutError(limit, stacks, ranks.run)

    def _interrupt(self, ranks: _Ranks, replies: dict[int, dict[str, Any]], call: int) -> None:
        """Stop button: SIGINT the ranks still running; keep the world if all come back."""
        running = [r for r in range(self.cfg.world_size) if r not in replies]
        try:
            for rank in running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(ranks.procs[rank].pid, signal.SIGINT)
            deadline = time.monotonic() + _GRACE_S
            lost = False  # a rank that died of the interrupt
            while running and not lost and time.monotonic() < deadline:
                for ready in wait([ranks.conns[r] for r in running], timeout=0.05):
                    rank = ranks.conns.index(ready)  # type: ignore[arg-type]
                    try:
                        ranks.conns[rank].recv()
                        running.remove(rank)
                    except (EOFError, OSError):
                        lost = True
        finally:
            ranks.print(set(), self.cfg.quiet, block=0.0)  # what the ranks said last
            if running or call == 0:
                self._break(f"ranks {running} did not stop on the interrupt")
                print(
                    f"labkit.World: ranks {running} did not stop on the interrupt; the world "
                    "was stopped and restarts on the next call",
                    file=sys.stderr,
                )
            else:
                print(
                    "labkit.World: interrupted; every rank stopped, the world is still usable",
                    file=sys.stderr,
                )
