"""The ranks' forkserver, forked from the agent after one import of torch instead of started as
a fresh interpreter that imports torch a second time.

Why: with ``start_method="forkserver"`` a launch used to import torch twice, once in the agent
(for torch's elastic agent) and once in multiprocessing's forkserver (its preload, so that each
rank forks with torch loaded). On the 2-core machine a 2-rank launch of one all-reduce took 3.44
s of the machine's CPU that way and takes 1.49 s now, 2.36 s and 2.00 s of wall time
(``benchmarks/bench_launch.py``, medians of 5, 2026-11-27); the test suite launches hundreds.

How: the agent imports the preload (``labkit.launch.rank``, torch with it) while it is still
single-threaded, then asks multiprocessing for its forkserver as usual, except that the one
call that would start a new interpreter (``util.spawnv_passfds``) forks this process instead
and runs the same command line in the child. The child is therefore exactly what a forkserver
is: a process that imported the preload and nothing else, serving fork requests, and every
rank still forks from it, never from the multi-threaded agent. What the child must not keep
from its parent is undone before the server starts: every file descriptor except the ones the
server is given (as ``spawnv_passfds`` closes them), the held forkserver lock, and the patch.

Any other command line, or a platform without ``fork``, falls back to the ordinary start.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Sequence
from multiprocessing import forkserver, util
from typing import Any


def _fork_and_run(path: Any, args: Sequence[Any], passfds: Sequence[int]) -> int:
    """``util.spawnv_passfds`` for the forkserver's own command line, by fork: returns the pid."""
    keep = sorted({0, 1, 2, *passfds})
    pid = os.fork()
    if pid:
        return pid
    try:  # the child: become the forkserver
        util.spawnv_passfds = _ORIGINAL  # ranks that start a forkserver of their own spawn it
        server: Any = forkserver._forkserver
        server._lock = threading.Lock()  # held by the parent at fork time
        for low, high in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")]):
            os.closerange(low + 1, high)
        exec(args[-1], {"__name__": "__labkit_forkserver__"})
        code = 0
    except SystemExit as stop:  # the server's way out once every client has gone
        code = stop.code if isinstance(stop.code, int) else 0
    except BaseException:  # noqa: BLE001 - the child must never return into the agent
        import traceback

        traceback.print_exc()
        code = 1
    os._exit(code)


_ORIGINAL = util.spawnv_passfds


def start_forkserver_here(preload: list[str]) -> None:
    """Import ``preload`` into this (single-threaded) process, then start multiprocessing's
    forkserver as a fork of it (module docstring). Later ``forkserver`` contexts in this
    process, torch's elastic agent's included, find it running and use it."""
    forkserver.set_forkserver_preload(preload)
    for name in preload:
        importlib.import_module(name)
    if not hasattr(os, "fork") or threading.active_count() != 1:
        forkserver.ensure_running()  # the ordinary start: forking here would not be safe
        return

    def spawn(path: Any, args: Sequence[Any], passfds: Sequence[int]) -> int:
        if len(args) >= 2 and args[-2] == "-c" and "multiprocessing.forkserver" in args[-1]:
            return _fork_and_run(path, args, passfds)
        return _ORIGINAL(path, args, passfds)

    util.spawnv_passfds = spawn
    try:
        forkserver.ensure_running()
    finally:
        util.spawnv_passfds = _ORIGINAL
