"""What runs on every rank: process-group set-up, the worker entry point, rank-side helpers.

The worker reports a failure *before* any teardown (``error.N.json``), then exits without
destroying the group: a clean teardown is what makes bystanders fail first with
"connection closed by peer" and hides the culprit.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import json
import linecache
import os
import random
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from labkit.launch.config import _JOB_FILE, LaunchConfig, choose_backend
from labkit.launch.runs import check_run_dir
from labkit.safe_files import open_private, replace_private

_PR_SET_PDEATHSIG = 1

# Exceptions that a rank raises because *another* rank went away. They are never the root
# cause while a rank with any other exception exists.
_COLLATERAL_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "socket closed",
    "nccl communicator was aborted",
    "process group was aborted",
    "connection refused",  # a peer exited while the group was still connecting
)


def local_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` under NCCL, the CPU otherwise."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy (when present) and torch (CPU and every GPU) with the same ``seed``."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass


def _set_pdeathsig() -> None:
    """Ask Linux to SIGKILL this process when its parent dies: a second, immediate layer under
    the job's lifeline (``lifeline.py``), which is what guarantees that nothing outlives a job
    (a death signal reaches only the direct children of the process that died)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _init_process_group(
    backend: str, timeout: float, enter: Callable[[], None] | None = None
) -> None:
    """Initialise the default group from the torchrun-style environment (RANK, WORLD_SIZE, ...).

    ``enter`` runs between the store's connection and the group's creation: an emulated
    cluster's rank moves into its node's network namespace there."""
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    limit = datetime.timedelta(seconds=timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # The agent's store outlives a restart; without a per-attempt prefix a restarted
        # group reads the dead attempt's gloo addresses and fails with "connection refused".
        store = dist.PrefixStore(
            f"labkit/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
            dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=limit,
            ),
        )
        if enter is not None:
            enter()
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=limit,
        )
    else:
        if enter is not None:
            raise RuntimeError("an emulated cluster needs the elastic agent's store")
        dist.init_process_group(backend=backend, timeout=limit)


def run_from_env(
    fn: Callable[..., Any], *args: Any, backend: str | None = None, timeout: float = 1800.0
) -> Any:
    """Run ``fn(*args)`` on this process as one rank of a ``torchrun`` job.

    ``torchrun --nproc-per-node 4 -m labkit.labs.mnist`` ends up here: the environment
    torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) initialises the
    default process group, so a worker function runs unchanged under either launcher.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if "RANK" not in os.environ:  # plain `python script.py`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port("127.0.0.1")))
    gpus_here = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    _init_process_group(choose_backend(gpus_here, backend), timeout)
    try:
        return fn(*args)
    finally:
        dist.destroy_process_group()


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _to_cpu(value: Any) -> Any:
    """Move tensors in a returned pytree to the CPU, so the caller never initialises CUDA."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, value)


def _is_collateral(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}".lower()
    if isinstance(exc, dist.DistNetworkError):
        return True
    return any(marker in text for marker in _COLLATERAL_MARKERS)


def _write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    replace_private(path, json.dumps(payload), sync=False)  # whole or absent, no link followed


def _error_record(rank: int, exc: BaseException, *, pending: bool = False) -> dict[str, Any]:
    """What the caller needs to blame a rank: type, message, traceback, collateral or not."""
    # Drop labkit's own launch frames: the traceback starts in the learner's code.
    here = os.path.dirname(__file__)
    tb = exc.__traceback__
    while tb is not None and os.path.dirname(tb.tb_frame.f_code.co_filename) == here:
        tb = tb.tb_next
    return {
        "rank": rank,
        "time": time.time(),
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, tb)),
        "collateral": _is_collateral(exc),
        "pending": pending,
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    }


def _report(run: Path, rank: int, exc: BaseException, *, pending: bool = False) -> None:
    """Write ``error.N.json`` (or ``error.N.pending.json`` for an exception still in flight)."""
    name = f"error.{rank}.pending.json" if pending else f"error.{rank}.json"
    _write_json_atomic(run / name, _error_record(rank, exc, pending=pending))


def _report_before_teardown(run: Path, rank: int) -> None:
    """Make ``destroy_process_group`` report an exception in flight before tearing down.

    The classic trap: ``try: ... finally: dist.destroy_process_group()``. The teardown runs
    while the real exception is still propagating; the peers see "connection closed by
    peer" and fail, the agent stops every rank, and the culprit is killed before it can say
    why. Inside that ``finally``, ``sys.exc_info()`` already holds the exception, so it is
    written now, as a *pending* record: it names the culprit, but never fails a job by itself
    (a handled exception can also be in flight there).
    """
    import torch.distributed.distributed_c10d as c10d

    real = c10d.destroy_process_group

    def destroy_process_group(*args: Any, **kwargs: Any) -> None:
        exc = sys.exc_info()[1]
        if exc is not None and not _is_collateral(exc):
            _report(run, rank, exc, pending=True)
        real(*args, **kwargs)

    c10d.destroy_process_group = destroy_process_group  # type: ignore[assignment]
    dist.destroy_process_group = destroy_process_group  # type: ignore[assignment]


def _worker(run_dir: str) -> None:
    """Entry point of every rank (module level, so elastic pickles it by reference)."""
    _set_pdeathsig()
    # A forked rank inherits the agent's Python SIGTERM handler, which cannot run while the
    # rank is blocked inside a collective: the default action makes the agent's stop instant.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    run = Path(run_dir)
    rank = int(os.environ["RANK"])
    # Worker stdout is a file, not a tty: without this, nothing shows until the rank exits.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    stack_file = open_private(run / f"stack.{rank}.txt", "a")  # lives as long as the rank
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    replace_private(run / f"pid.{rank}", str(os.getpid()), sync=False)  # a restart rewrites it
    _report_before_teardown(run, rank)

    check_run_dir(run)  # as the agent did: nothing is unpickled from a folder others can write
    with open(run / _JOB_FILE, "rb") as f:
        job = cloudpickle.load(f)
        linecache.cache.update(cloudpickle.load(f))
    cfg: LaunchConfig = job["config"]
    if cfg.backend == "gloo":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        cluster = job.get("cluster")  # a labkit.cluster.run.ClusterRun, or None
        enter = None if cluster is None else (lambda: cluster.enter(rank))
        _init_process_group(str(cfg.backend), float(cfg.collective_timeout or cfg.timeout), enter)
        if cluster is not None:
            cluster.install(run)
        result = job["fn"](*job["args"])
        # the caller never reads half a result (replace), nor one through a planted link
        replace_private(run / f"result.{rank}.pkl", cloudpickle.dumps(_to_cpu(result)), sync=False)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, then the rank exits
        _report(run, rank, exc)
        sys.stdout.flush()
        sys.stderr.flush()
        # Exit without tearing the group down: a clean teardown here is what makes the
        # *other* ranks fail first with "connection closed", hiding the real culprit.
        os._exit(1)
    # Success. Leave together: a rank that exits while a peer is still connecting (gloo
    # builds its mesh lazily) or still receiving makes that peer fail "connection closed".
    with contextlib.suppress(Exception):
        dist.barrier()
        dist.destroy_process_group()
