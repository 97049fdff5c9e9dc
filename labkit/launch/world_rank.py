"""What runs on every rank of a :class:`labkit.World`: set up once, then serve calls forever.

A rank joins the default process group once, then loops: receive a call from the caller over
its socket, run it, flush its output, mark the end of the call on stdout and stderr (so the
caller has printed every line of a call before it returns), send back the result or the
error record. The loop ends when the caller's socket closes; ``close`` kills the rank's whole
process group (:mod:`labkit.launch.lifeline`), which also ends it when the caller dies.

Two kinds of call: ``run`` (a pickled function, as ``launch`` ships it) and ``exec`` (cell
source run in this rank's persistent namespace, the body of a ``%%ranks`` cell). An
``isolate`` call (the test suite's) starts barrier-synchronised with fresh-process defaults
and leaves no subgroup, environment change or working-directory change behind.
"""

from __future__ import annotations

import ast
import contextlib
import datetime
import faulthandler
import io
import linecache
import os
import signal
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from labkit.launch.rank import _error_record, _to_cpu
from labkit.safe_files import open_private, replace_private

# A rank started as its own interpreter (``python -c``; where ranks are not forked, world_zygote)
RANK_BOOTSTRAP = (
    "import sys; from labkit.launch.world_rank import rank_main; "
    "rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:])"
)
END_MARK = "\x1flabkit-end "  # + call id + newline, on stdout and stderr after every call
_FRESH_SEED = torch.initial_seed()  # what torch's default generator starts from in a new process


class _Interruptible:
    """SIGINT raises ``KeyboardInterrupt`` only while the learner's code runs: a stop that
    arrives between calls must not kill the serving loop."""

    def __init__(self) -> None:
        self.running = False
        signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.running:
            raise KeyboardInterrupt


def _join(rank: int, world_size: int, backend: str, store: tuple[str, int], timeout: float) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=store[0],
        MASTER_PORT=str(store[1]),
    )
    if backend == "nccl":
        torch.cuda.set_device(rank)
    limit = datetime.timedelta(seconds=timeout)
    client = dist.TCPStore(store[0], store[1], world_size, is_master=False, timeout=limit)
    dist.init_process_group(backend, store=client, rank=rank, world_size=world_size, timeout=limit)


def _leave_no_subgroups() -> None:
    """Destroy every group but the default one (a job's subgroups, a DeviceMesh's groups)."""
    import torch.distributed.distributed_c10d as c10d

    default = c10d._get_default_group()
    for group in list(c10d._world.pg_map):
        if group is not default:
            dist.destroy_process_group(group)
    with contextlib.suppress(ImportError, AttributeError):  # a private, version-dependent cache
        from torch.distributed.device_mesh import _mesh_resources

        _mesh_resources.mesh_stack.clear()


def _fresh_defaults() -> None:
    """The process-wide defaults a freshly started rank would have."""
    torch.manual_seed(_FRESH_SEED)
    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)


def _exec_cell(source: str, filename: str, ns: dict[str, Any]) -> Any:
    """Run cell source in ``ns``; return the value of its last line when that is an expression."""
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    tree = ast.parse(source, filename)
    last = tree.body[-1] if tree.body else None
    if not isinstance(last, ast.Expr):
        exec(compile(tree, filename, "exec"), ns)
        return None
    tree.body.pop()
    exec(compile(tree, filename, "exec"), ns)
    return eval(compile(ast.Expression(last.value), filename, "eval"), ns)


def _run_job(msg: dict[str, Any], ns: dict[str, Any], guard: _Interruptible) -> Any:
    """Run one call's user code (the frame where stack dumps and tracebacks are cut)."""
    guard.running = True
    try:
        if msg["kind"] == "exec":
            return _exec_cell(msg["source"], msg["filename"], ns)
        buffer = io.BytesIO(msg["payload"])
        job = cloudpickle.load(buffer)
        linecache.cache.update(cloudpickle.load(buffer))
        return job["fn"](*job["args"])
    finally:
        guard.running = False


def _serve_one(
    msg: dict[str, Any], rank: int, ns: dict[str, Any], guard: _Interruptible
) -> dict[str, Any]:
    if msg["isolate"]:
        env, cwd = dict(os.environ), os.getcwd()
        _fresh_defaults()
    try:
        if msg["isolate"]:
            dist.barrier()  # every job starts with the ranks in step
        value = _run_job(msg, ns, guard)
        reply = {"ok": True, "value": cloudpickle.dumps(_to_cpu(value))}
    except BaseException as exc:  # noqa: BLE001 - reported to the caller, the rank lives on
        reply = {"ok": False, "error": _error_record(rank, exc)}
    reply["group_intact"] = dist.is_initialized()
    if msg["isolate"]:
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                _leave_no_subgroups()
        os.environ.clear()
        os.environ.update(env)
        with contextlib.suppress(OSError):
            os.chdir(cwd)
    return reply


def _serve(conn: Connection, rank: int, world_size: int) -> None:
    guard = _Interruptible()
    ns: dict[str, Any] = {"__name__": "__ranks__", "torch": torch, "dist": dist, "rank": rank}
    ns["world_size"] = world_size
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the caller is gone
        reply = _serve_one(msg, rank, ns, guard)
        reply["call"] = msg["call"]
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
                stream.write(f"{END_MARK}{msg['call']}\n")
                stream.flush()
        try:
            conn.send(reply)
        except (TypeError, ValueError, AttributeError) as exc:  # an unpicklable result
            conn.send({"call": msg["call"], "ok": False, "error": _error_record(rank, exc)})
        except OSError:
            return


def rank_main(fd: int, rank: int, world_size: int, backend: str, store: str, run_dir: str) -> None:
    """Entry point of a world rank, forked by the world's zygote (or started as ``python -c``),
    in the world's process group (no death signal: it would follow the thread that created the
    World)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    faulthandler.enable(file=sys.stderr, all_threads=True)  # a native crash prints the stack
    run = Path(run_dir)
    stack_file = open_private(run / f"stack.{rank}.txt", "a")  # appended per dump
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    replace_private(run / f"pid.{rank}", str(os.getpid()), sync=False)
    conn = Connection(fd)
    if backend == "gloo":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    host, port = store.rsplit(":", 1)
    timeout = float(os.environ["LABKIT_COLLECTIVE_TIMEOUT"])
    try:
        _join(rank, world_size, backend, (host, int(port)), timeout)
    except BaseException as exc:  # noqa: BLE001
        conn.send({"call": 0, "ok": False, "error": _error_record(rank, exc)})
        return
    conn.send({"call": 0, "ok": True, "pid": os.getpid()})
    _serve(conn, rank, world_size)
    os._exit(0)  # no teardown handshake: the caller ends every rank together
