"""Run a function on N ranks, from a notebook cell or a script: all process plumbing lives here.

``launch(fn, *args, world_size=2)`` runs ``fn(*args)`` on ``world_size`` processes with
``torch.distributed`` initialised and returns the per-rank results, indexed by rank.

How a launch is built (the same engine as ``torchrun``)::

    kernel (your notebook)                 agent subprocess                  workers
    ----------------------                 ----------------                  -------
    cloudpickle fn+args -> run_dir/job.pkl
    Popen(python -m labkit.launch run_dir) elastic_launch(config, _worker) -> rank 0 .. N-1
    print each "[rankN]: ..." line   <---- tee of every worker's stdout/stderr
    watchdog: at the deadline SIGUSR1 ----------------------------------------> faulthandler stacks
    read result.N.pkl / error.N.json <----------------------------------------- written by _worker

Why an agent subprocess rather than ``elastic_launch`` inside the kernel: the elastic agent
installs signal handlers and writes ``os.environ`` in the process that calls it. In a
subprocess the kernel keeps its own handlers, an interrupt is a plain ``KeyboardInterrupt``,
and killing one process tree ends the whole job.

Invariants the tests hold this module to:

* a raising rank fails the job within seconds; the exception names that rank and carries its
  traceback, never a bystander that only saw "connection closed by peer";
* a hang ends at ``timeout`` with every rank's Python stack;
* no process outlives its job (success, failure, timeout, interrupt); workers also die with
  their agent (``PR_SET_PDEATHSIG``) and the agent with its launcher;
* every launch rendezvous on its own free port on 127.0.0.1.

Under ``torchrun`` the same worker functions run unchanged through :func:`run_from_env`.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import json
import linecache
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cloudpickle
import cloudpickle.cloudpickle as _cp
import torch
import torch.distributed as dist

__all__ = [
    "LaunchConfig",
    "LaunchError",
    "RankFailedError",
    "JobTimeoutError",
    "launch",
    "choose_backend",
    "describe_machine",
    "local_device",
    "seed_everything",
    "run_from_env",
]

_JOB_FILE = "job.pkl"
_ENV_RUN_ID = "LABKIT_RUN_ID"
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


# --------------------------------------------------------------------------------------
# Errors seen by the caller
# --------------------------------------------------------------------------------------


class LaunchError(RuntimeError):
    """A distributed job did not complete. ``log_dir`` holds every rank's stdout/stderr."""

    def __init__(self, message: str, log_dir: Path | None = None):
        super().__init__(message)
        self.log_dir = log_dir


class RankFailedError(LaunchError):
    """A rank raised. ``rank``, ``exc_type`` and ``rank_traceback`` describe the root cause."""

    def __init__(
        self,
        rank: int,
        exc_type: str,
        exc_message: str,
        rank_traceback: str,
        log_dir: Path | None,
        others: Sequence[int] = (),
    ):
        self.rank = rank
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.rank_traceback = rank_traceback
        self.other_failed_ranks = list(others)
        also = (
            f"\n(ranks {self.other_failed_ranks} failed too, as a consequence)"
            if self.other_failed_ranks
            else ""
        )
        super().__init__(
            f"rank {rank} raised {exc_type}: {exc_message}{also}\n\n"
            f"--- traceback on rank {rank} ---\n{rank_traceback.rstrip()}\n\nlogs: {log_dir}",
            log_dir,
        )


class JobTimeoutError(LaunchError):
    """The job ran past its timeout. ``stacks[rank]`` is where each rank was stuck."""

    def __init__(self, timeout: float, stacks: dict[int, str], log_dir: Path | None):
        self.timeout = timeout
        self.stacks = stacks
        parts = [f"job still running after timeout={timeout:g}s; every rank's stack at that moment:"]
        for rank in sorted(stacks):
            parts.append(f"\n--- rank {rank} ---\n{stacks[rank].rstrip() or '(no stack captured)'}")
        parts.append(f"\nlogs: {log_dir}")
        super().__init__("\n".join(parts), log_dir)


# --------------------------------------------------------------------------------------
# Configuration, validated before any process starts
# --------------------------------------------------------------------------------------


@dataclass
class LaunchConfig:
    """Everything a launch needs besides the function. Validated in ``__post_init__``."""

    world_size: int = 2
    backend: str | None = None  # None: nccl when there is a GPU per rank, else gloo
    timeout: float = 300.0  # wall clock for the whole job
    collective_timeout: float | None = None  # bound on each collective; None: same as timeout
    max_restarts: int = 0  # elastic restarts of the whole worker group after a failure
    start_method: str | None = None  # None: fork for gloo (fast), spawn for nccl (CUDA-safe)
    threads_per_rank: int | None = None  # None: cores // world_size on CPU, at least 1
    host: str = "127.0.0.1"  # rendezvous address; "0.0.0.0" to accept other nodes
    log_dir: Path | None = None  # None: a fresh folder under tempdir/labkit-runs
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the workers
    quiet: bool = False  # True: do not echo worker output (it is still logged)

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int):
            raise TypeError(f"world_size must be an int, got {self.world_size!r}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not (isinstance(self.timeout, int | float) and self.timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        if self.collective_timeout is None:
            self.collective_timeout = float(self.timeout)
        elif not self.collective_timeout > 0:
            raise ValueError(f"collective_timeout must be positive, got {self.collective_timeout!r}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.start_method is None:
            # The agent never touches CUDA, but spawn keeps NCCL ranks safe from any fork hazard.
            self.start_method = "fork" if choose_backend(self.world_size, self.backend) == "gloo" else "spawn"
        if self.start_method not in ("spawn", "fork", "forkserver"):
            raise ValueError(f"start_method must be spawn, fork or forkserver, got {self.start_method!r}")
        if self.threads_per_rank is not None and self.threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be >= 1, got {self.threads_per_rank}")
        self.backend = choose_backend(self.world_size, self.backend)


def describe_machine() -> dict[str, Any]:
    """What this machine offers a distributed job: the facts notebook 00 opens with."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {
        "torch": torch.__version__,
        "cpu cores": os.cpu_count(),
        "GPUs": [torch.cuda.get_device_name(i) for i in range(gpus)],
        "gloo available": dist.is_gloo_available(),
        "nccl available": dist.is_nccl_available(),
        "backend for 2 ranks": choose_backend(2),
    }


def choose_backend(world_size: int, backend: str | None = None) -> str:
    """NCCL with one GPU per rank when enough GPUs exist, gloo otherwise; a forced choice is checked."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is None:
        return "nccl" if gpus >= world_size and dist.is_nccl_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
    if backend == "nccl" and gpus < world_size:
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: world_size={world_size} but {gpus} GPU(s) visible"
        )
    return backend


# --------------------------------------------------------------------------------------
# Helpers for code that runs on a rank
# --------------------------------------------------------------------------------------


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
    """Ask Linux to SIGKILL this process when its parent dies, so nothing outlives a job."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _init_process_group(backend: str, timeout: float) -> None:
    """Initialise the default group from the torchrun-style environment (RANK, WORLD_SIZE, ...)."""
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    limit = datetime.timedelta(seconds=timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # The agent's store outlives a restart; without a per-attempt prefix a restarted
        # group reads the dead attempt's gloo addresses and fails with "connection refused".
        store = dist.PrefixStore(
            f"labkit/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
            dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=limit),
        )
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=limit,
        )
    else:
        dist.init_process_group(backend=backend, timeout=limit)


def run_from_env(fn: Callable[..., Any], *args: Any, backend: str | None = None, timeout: float = 1800.0) -> Any:
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


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, but functions keep their real file name (cloudpickle writes "<dynamic-code>").

    With the file name, and the kernel's ``linecache`` entries shipped alongside, a rank's
    traceback shows the notebook cell's own lines instead of anonymous frames.
    """

    def __init__(self, file: Any):
        super().__init__(file)
        self.filenames: set[str] = set()

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.CodeType) and hasattr(_cp, "_code_reduce"):
            ctor, args = _cp._code_reduce(obj)
            self.filenames.add(obj.co_filename)
            return ctor, tuple(obj.co_filename if a == "<dynamic-code>" else a for a in args)
        return super().reducer_override(obj)


def _dumps(job: dict[str, Any]) -> bytes:
    import io

    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.dump(job)
    # Source of code that exists only in memory (notebook cells): tracebacks need it.
    sources = {
        name: (len("".join(entry[2])), None, entry[2], name)
        for name in pickler.filenames
        if (entry := linecache.cache.get(name)) is not None and len(entry) == 4 and not os.path.exists(name)
    }
    return buffer.getvalue() + cloudpickle.dumps(sources)


# --------------------------------------------------------------------------------------
# The worker: runs on every rank, inside the elastic agent's process tree
# --------------------------------------------------------------------------------------


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
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


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
    stack_file = open(run / f"stack.{rank}.txt", "w")  # noqa: SIM115 - lives as long as the rank
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    (run / f"pid.{rank}").write_text(str(os.getpid()))

    with open(run / _JOB_FILE, "rb") as f:
        job = cloudpickle.load(f)
        linecache.cache.update(cloudpickle.load(f))
    cfg: LaunchConfig = job["config"]
    if cfg.backend == "gloo":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        _init_process_group(str(cfg.backend), float(cfg.collective_timeout or cfg.timeout))
        result = job["fn"](*job["args"])
        with open(run / f"result.{rank}.pkl", "wb") as f:
            cloudpickle.dump(_to_cpu(result), f)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, then the rank exits
        # Drop this wrapper's own frame: the traceback starts in the learner's code.
        tb = traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next if exc.__traceback__ else None)
        _write_json_atomic(
            run / f"error.{rank}.json",
            {
                "rank": rank,
                "time": time.time(),
                "type": type(exc).__name__,
                "message": str(exc),
                "traceback": "".join(tb),
                "collateral": _is_collateral(exc),
                "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            },
        )
        sys.stdout.flush()
        sys.stderr.flush()
        # Exit without tearing the group down: a clean teardown here is what makes the
        # *other* ranks fail first with "connection closed", hiding the real culprit.
        os._exit(1)
    # Success: a barrier-free teardown; every rank has already returned from fn.
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------
# The agent: `python -m labkit.launch RUN_DIR`, a thin shell around torch's elastic_launch
# --------------------------------------------------------------------------------------


def _agent_main(run_dir: str, parent_pid: int) -> int:
    _set_pdeathsig()
    if os.getppid() != parent_pid:  # the launcher died before prctl took effect
        return 1
    import logging

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig as ElasticConfig
    from torch.distributed.launcher.api import elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    run = Path(run_dir)
    with open(run / _JOB_FILE, "rb") as f:
        cfg: LaunchConfig = cloudpickle.load(f)["config"]
    config = ElasticConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.world_size,
        run_id=run.name,
        rdzv_backend="c10d",
        rdzv_endpoint=f"{cfg.host}:0",  # port 0: the OS picks a free port, no collisions
        rdzv_configs={"timeout": 60},
        local_addr=cfg.host,
        max_restarts=cfg.max_restarts,
        monitor_interval=0.05,
        start_method=str(cfg.start_method),
        log_line_prefix_template="[rank${rank}]: ",
        logs_specs=DefaultLogsSpecs(log_dir=str(run / "logs"), redirects=Std.ALL, tee=Std.ALL),
        shutdown_timeout=2,
    )
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        elastic_launch(config, _worker)(run_dir)
    except ChildFailedError as exc:
        died = [
            {"rank": rank, "exitcode": f.exitcode, "signal": f.signal_name() if f.exitcode < 0 else ""}
            for rank, f in sorted(exc.failures.items())
        ]
        _write_json_atomic(run / "agent_failures.json", {"failures": died})
        return 1
    except Exception as exc:  # noqa: BLE001 - the launcher reads error.N.json for details
        (run / "agent_error.txt").write_text(f"{type(exc).__name__}: {exc}")
        return 1
    return 0


# --------------------------------------------------------------------------------------
# The launcher: what a notebook cell calls
# --------------------------------------------------------------------------------------


def _runs_root() -> Path:
    return Path(tempfile.gettempdir()) / "labkit-runs"


def _prune_old_runs(root: Path, keep: int = 30) -> None:
    with contextlib.suppress(OSError):
        runs = sorted(root.iterdir(), key=lambda p: p.stat().st_mtime)
        for old in runs[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def _kill_tree(proc: subprocess.Popen[bytes], run: Path) -> None:
    """SIGKILL the agent, every descendant, and any rank whose pid file we know."""
    import psutil

    pids: set[int] = set()
    with contextlib.suppress(psutil.Error):
        pids.update(c.pid for c in psutil.Process(proc.pid).children(recursive=True))
    for pid_file in run.glob("pid.*"):
        with contextlib.suppress(ValueError, OSError):
            pids.add(int(pid_file.read_text()))
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if p.environ().get(_ENV_RUN_ID) == run.name:  # never kill a recycled pid
                p.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    psutil.wait_procs([p for p in _alive(pids)], timeout=5)


def _alive(pids: set[int]) -> list[Any]:
    import psutil

    out = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            out.append(psutil.Process(pid))
    return out


def _dump_stacks(run: Path, world_size: int, wait: float = 1.5) -> dict[int, str]:
    """SIGUSR1 every rank (faulthandler writes its stack), then read what they wrote."""
    for rank in range(world_size):
        with contextlib.suppress(ValueError, OSError, ProcessLookupError):
            os.kill(int((run / f"pid.{rank}").read_text()), signal.SIGUSR1)
    deadline = time.monotonic() + wait
    stacks: dict[int, str] = {}
    while time.monotonic() < deadline:
        stacks = {}
        for rank in range(world_size):
            path = run / f"stack.{rank}.txt"
            stacks[rank] = path.read_text() if path.exists() else ""
        if all(s.rstrip().endswith(("in _worker", "(most recent call first):")) or "_worker" in s for s in stacks.values()):
            break
        time.sleep(0.05)
    return {rank: _trim_stack(text) for rank, text in stacks.items()}


def _trim_stack(text: str) -> str:
    """Keep each thread's frames down to labkit's ``_worker``: below it is only machinery."""
    kept: list[str] = []
    skipping = False
    for line in text.splitlines():
        if not line.startswith(" "):  # a "Thread 0x... (most recent call first):" header
            skipping = False
        elif skipping:
            continue
        elif "labkit" in line and line.rstrip().endswith("in _worker"):
            skipping = True
            continue
        kept.append(line)
    return "\n".join(kept)


def _error_records(run: Path) -> list[dict[str, Any]]:
    records = []
    for path in run.glob("error.*.json"):
        with contextlib.suppress(OSError, ValueError):
            records.append(json.loads(path.read_text()))
    return records


def _final_failure(records: list[dict[str, Any]], max_restarts: int) -> bool:
    """True once a rank has failed in the last attempt elastic is allowed to make."""
    return any(r["restart"] >= max_restarts for r in records)


def _root_cause(run: Path, log_dir: Path) -> RankFailedError | None:
    """The failing rank to blame: a genuine exception beats 'connection closed by peer'.

    A rank killed by a signal or a native crash leaves no Python record; the agent's view of
    exit codes (``agent_failures.json``) names it instead.
    """
    records = _error_records(run)
    if records:
        last_restart = max(r["restart"] for r in records)
        records = [r for r in records if r["restart"] == last_restart]
        records.sort(key=lambda r: (r["collateral"], r["time"]))
        root = records[0]
        others = sorted(r["rank"] for r in records[1:])
        if not root["collateral"] or not (run / "agent_failures.json").exists():
            return RankFailedError(root["rank"], root["type"], root["message"], root["traceback"], log_dir, others)
    died = run / "agent_failures.json"
    if died.exists():
        every = json.loads(died.read_text())["failures"]
        failures = [f for f in every if f["signal"]] or every
        if failures:
            f = failures[0]
            how = f"was killed by {f['signal']}" if f["signal"] else f"exited with code {f['exitcode']}"
            return RankFailedError(
                f["rank"],
                "ProcessDied",
                f"the process {how}",
                "(no Python traceback: the process was killed, ran out of memory, or crashed in native code)",
                log_dir,
                [g["rank"] for g in failures[1:]],
            )
    return None


def _pump(stream: Any, tag: str, lines: queue.Queue[tuple[str, str]]) -> None:
    for raw in iter(stream.readline, b""):
        lines.put((tag, raw.decode(errors="replace")))
    stream.close()


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
    ``start_method``, ``threads_per_rank``, ``host``, ``log_dir``, ``env``, ``quiet``).

    Raises :class:`RankFailedError` when a rank raises, :class:`JobTimeoutError` when the job
    outlives ``timeout`` seconds, ``KeyboardInterrupt`` when interrupted (all ranks killed).
    """
    if not callable(fn):
        raise TypeError(f"launch() needs a callable as its first argument, got {type(fn).__name__}: {fn!r}")
    cfg = LaunchConfig(world_size=world_size, backend=backend, timeout=timeout, **options)

    root = Path(cfg.log_dir) if cfg.log_dir is not None else _runs_root()
    root.mkdir(parents=True, exist_ok=True)
    _prune_old_runs(root)
    run = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6] + "-", dir=root))
    try:
        payload = _dumps({"fn": fn, "args": args, "config": cfg})
    except Exception as exc:
        raise TypeError(f"cannot send fn and args to the ranks (pickling failed): {exc}") from exc
    (run / _JOB_FILE).write_bytes(payload)

    cores = os.cpu_count() or 1
    threads = cfg.threads_per_rank or max(1, cores // cfg.world_size)
    env = {
        **os.environ,
        **cfg.env,
        _ENV_RUN_ID: run.name,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": str(threads),
        # The agent should never see the kernel's signal bookkeeping.
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    }
    # Make sure the agent imports *this* labkit, even from a notebook's working directory.
    pkg_parent = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH", "")) if p)

    proc = subprocess.Popen(
        [sys.executable, "-m", "labkit.launch", str(run), str(os.getpid())],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,  # a terminal's Ctrl-C reaches us, and we decide what dies
    )
    lines: queue.Queue[tuple[str, str]] = queue.Queue()
    pumps = [
        threading.Thread(target=_pump, args=(proc.stdout, "out", lines), daemon=True),
        threading.Thread(target=_pump, args=(proc.stderr, "err", lines), daemon=True),
    ]
    for t in pumps:
        t.start()

    agent_noise: list[str] = []

    def drain(block_for: float) -> None:
        # Printing from this (the caller's) thread keeps output in the running cell.
        try:
            tag, line = lines.get(timeout=block_for)
        except queue.Empty:
            return
        while True:
            if line.startswith("[rank"):
                if not cfg.quiet:
                    (sys.stdout if tag == "out" else sys.stderr).write(line)
            else:
                agent_noise.append(line)
            try:
                tag, line = lines.get_nowait()
            except queue.Empty:
                break
        sys.stdout.flush()
        sys.stderr.flush()

    deadline = time.monotonic() + cfg.timeout
    first_failure: float | None = None
    try:
        while proc.poll() is None:
            drain(0.05)
            if time.monotonic() > deadline:
                stacks = _dump_stacks(run, cfg.world_size)
                _kill_tree(proc, run)
                raise JobTimeoutError(cfg.timeout, stacks, run / "logs")
            # Fail fast: once a rank has failed for good, kill everything now rather than
            # wait for the agent's polite shutdown. A collateral error ("connection closed")
            # gets a short grace period for the culprit's own record to land.
            records = _error_records(run)
            if records and _final_failure(records, cfg.max_restarts):
                first_failure = first_failure or time.monotonic()
                genuine = any(not r["collateral"] for r in records)
                if genuine or time.monotonic() - first_failure > 1.0:
                    break
    except BaseException:
        _kill_tree(proc, run)
        raise
    finally:
        _kill_tree(proc, run)  # also reaps ranks of an agent that exited on its own
        for t in pumps:
            t.join(timeout=2)
        drain(0)

    if first_failure is not None or proc.returncode != 0:
        failure = _root_cause(run, run / "logs")
        if failure is not None:
            raise failure
        agent_error = run / "agent_error.txt"
        detail = agent_error.read_text() if agent_error.exists() else "".join(agent_noise[-40:])
        raise LaunchError(f"the job failed before any rank reported an error:\n{detail}", run / "logs")

    results = []
    for rank in range(cfg.world_size):
        with open(run / f"result.{rank}.pkl", "rb") as f:
            results.append(cloudpickle.load(f))
    return results


if __name__ == "__main__":
    sys.exit(_agent_main(sys.argv[1], int(sys.argv[2])))
