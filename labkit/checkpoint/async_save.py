"""Asynchronous saves: copy the shards off the training path, write them while training runs.

A synchronous save stops training for serialize + write + fsync of every shard. Here a save
costs the training loop only (Nebula, CheckFreq -- Mohan et al. 2021 -- and torch's
``dcp.async_save`` split it the same way):

1. the collective start (:func:`labkit.checkpoint.commit.prepare`: one barrier);
2. a snapshot: every tensor copied to CPU memory (pinned on a GPU, so the device-to-host copy
   is asynchronous on the current stream; the writer waits on a CUDA event, and later kernels
   on that stream run after the copy, so training may overwrite the parameters at once).
   Snapshot buffers are reused from the previous save, which has finished by then;

then a background thread serializes, writes, fsyncs and commits (:mod:`~.commit`: no
collective in the thread). The next save waits for the previous one first, so at most one is
in flight and a slow disk turns into a stall at the next save, never into a pile-up.

Atomic at every instant: the thread writes into ``.tmp-step_N`` and only rank 0's rename
commits, after every rank's part record exists; a crash or an exception before it leaves
the previous checkpoint the newest (tests/test_checkpoint_async.py kills a writer mid-write).

Two formats: :meth:`AsyncCheckpointer.save` writes ``save_checkpoint``'s sharded format (a
replicated state, ZeRO slices; read with :func:`labkit.checkpoint.load_checkpoint`),
:meth:`AsyncCheckpointer.save_logical` the logical one (:mod:`~.logical`, any layout).
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from labkit.checkpoint import logical
from labkit.checkpoint.commit import Fault, commit, prepare, rank_and_size, write_part
from labkit.checkpoint.layout import FORMAT, join_tree, shard_range, split_tree, to_bytes
from labkit.checkpoint.logical import LogicalState

__all__ = ["AsyncCheckpointer", "SaveHandle", "save_logical"]


class SaveHandle:
    """One save in flight. :meth:`wait` returns once this rank's part is durable (rank 0: once
    the checkpoint is committed) and re-raises the writer's exception, if any."""

    def __init__(self, step: int, path: Path, work: Callable[[], None], background: bool):
        self.step, self.path = step, path
        self.error: BaseException | None = None
        self.seconds = 0.0  # how long the write (and, on rank 0, the commit) took
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, args=(work,), daemon=True,
                                            name=f"labkit-save-{step}")  # fmt: skip
            self._thread.start()
        else:
            self._run(work)

    def _run(self, work: Callable[[], None]) -> None:
        start = time.perf_counter()
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            self.error = exc
        self.seconds = time.perf_counter() - start

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"save of step {self.step} still writing after {timeout} s")
        if self.error is not None:
            raise self.error
        return self.path


class AsyncCheckpointer:
    """One per rank and run: ``save(step, state)`` / ``save_logical(step, state)`` return a
    :class:`SaveHandle` after the snapshot; ``finish()`` (collective) before reading back or
    exiting. Collective: every rank
    of ``group`` saves the same steps. ``fault(point)`` is a test hook run in the writer at
    "written" (shards durable, nothing committed) and "before_commit" (rank 0)."""

    def __init__(self, root: str | Path, *, keep: int = 3, group: dist.ProcessGroup | None = None,
                 background: bool = True, timeout: float = 600.0,
                 fault: Fault | None = None) -> None:  # fmt: skip
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root, self.keep, self.group = Path(root), keep, group
        self.background, self.timeout, self.fault = background, timeout, fault
        self.pending: SaveHandle | None = None
        self.abort = threading.Event()
        self._pool: list[torch.Tensor] = []  # snapshot buffers, reused save after save
        # the writer is a daemon thread (a dead peer must not hang the exit forever), so a
        # program that ends without finish() would drop the save in flight: finish it at exit
        atexit.register(_finish_at_exit, weakref.ref(self))

    def wait(self) -> Path | None:
        """Wait for the save in flight (re-raising its error); None when there is none."""
        pending, self.pending = self.pending, None
        return None if pending is None else pending.wait()

    def finish(self) -> Path | None:
        """Collective over ``group``: wait for the save in flight, then a barrier, so that on
        every rank the checkpoint is committed when this returns (rank 0 commits)."""
        path = self.wait()
        if rank_and_size(self.group)[1] > 1:
            dist.barrier(self.group)
        return path

    def close(self) -> None:
        """Stop a commit still waiting for parts (a peer died), then wait for the thread."""
        self.abort.set()
        try:
            self.wait()
        finally:
            self.abort.clear()

    # ------------------------------------------------------------------ snapshots
    def _snapshot(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
        """CPU copies of ``tensors`` (pinned, non-blocking from a GPU) and the CUDA event the
        writer waits on (None on CPU)."""
        out, event = [], None
        for i, t in enumerate(tensors):
            t = t.detach()
            pin = t.is_cuda
            buf = self._pool[i] if i < len(self._pool) else None
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
                self._pool[i : i + 1] = [buf]
            buf.copy_(t, non_blocking=pin)
            out.append(buf)
        del self._pool[len(tensors) :]
        if any(t.is_cuda for t in tensors):
            event = torch.cuda.Event()
            event.record()
        return out, event

    def _start(
        self, step: int, write: Callable[[], tuple[dict[str, bytes], dict[str, Any]]], merge: Any
    ) -> SaveHandle:
        rank, world = rank_and_size(self.group)
        tmp, final = prepare(self.root, step, self.group)

        def work() -> None:
            files, record = write()
            write_part(tmp, rank, files, record, self.fault)
            if rank == 0:
                commit(self.root, tmp, final, world, merge, keep=self.keep,
                       timeout=self.timeout, fault=self.fault, abort=self.abort)  # fmt: skip

        self.pending = SaveHandle(step, final, work, self.background)
        return self.pending

    # ------------------------------------------------------------------ the two formats
    def save(self, step: int, state: dict[str, Any], *,
             rank_state: dict[str, Any] | None = None) -> SaveHandle:  # fmt: skip
        """``save_checkpoint``'s format: ``state`` replicated on every rank, each writing its
        flat slice ``shard_range(numel, rank, world)`` of every tensor."""
        self.wait()  # the next save waits for the previous one
        rank, world = rank_and_size(self.group)
        tensors: dict[str, torch.Tensor] = {}
        skeleton = split_tree(state, "", tensors)
        ranges = {k: shard_range(t.numel(), rank, world) for k, t in tensors.items()}
        views = [t.detach().reshape(-1)[slice(*ranges[k])] for k, t in tensors.items()]
        rs: dict[str, torch.Tensor] = {}
        rs_skeleton = split_tree(rank_state or {}, "", rs)
        copies, event = self._snapshot([*views, *rs.values()])
        table = {k: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                     "numel": t.numel(),
                     "slices": [[r, *shard_range(t.numel(), r, world)] for r in range(world)]}
                 for k, t in tensors.items()}  # fmt: skip

        def write() -> tuple[dict[str, bytes], dict[str, Any]]:
            if event is not None:
                event.synchronize()
            slices = dict(zip(tensors, copies[: len(tensors)]))
            mine = join_tree(rs_skeleton, dict(zip(rs, copies[len(tensors) :])))
            files = {f"shard_{rank:05d}.pt": to_bytes({"slices": slices, "rank_state": mine})}
            if rank == 0:
                files["common.pt"] = to_bytes({"skeleton": skeleton})
            return files, {}

        def merge(parts: list[Any]) -> dict[str, Any]:
            return {"format": FORMAT, "step": step, "world_size": world, "time": time.time(),
                    "tensors": table}  # fmt: skip

        return self._start(step, write, merge)

    def save_logical(self, step: int, state: LogicalState) -> SaveHandle:
        """The logical format (:mod:`labkit.checkpoint.logical`): this rank's owned chunks."""
        self.wait()
        rank, _ = rank_and_size(self.group)
        flat = [(k, d, p) for k, chunks in state.chunks.items() for d, p in chunks]
        rs: dict[str, torch.Tensor] = {}
        rs_skeleton = split_tree(state.rank_state, "", rs)
        copies, event = self._snapshot([d for _, d, _ in flat] + list(rs.values()))
        snap = LogicalState(tp_dims=dict(state.tp_dims), objects=dict(state.objects),
                            layout=dict(state.layout))  # fmt: skip
        for (key, _, place), copy in zip(flat, copies):
            snap.chunks.setdefault(key, []).append((copy, place))
        snap.rank_state = join_tree(rs_skeleton, dict(zip(rs, copies[len(flat) :])))

        def write() -> tuple[dict[str, bytes], dict[str, Any]]:
            if event is not None:
                event.synchronize()
            return logical.encode(snap, rank)

        return self._start(step, write, lambda parts: logical.merge(parts, step))


def _finish_at_exit(ref: weakref.ref[AsyncCheckpointer]) -> None:
    """At interpreter exit: wait for a save still in flight (its commit times out after
    ``timeout`` s if a peer is gone), and say loudly, naming the step, if it was not written."""
    saver = ref()
    pending = None if saver is None else saver.pending
    if saver is None or pending is None:
        return
    if not pending.done():
        print(f"labkit: the checkpoint of step {pending.step} was still being written at "
              f"exit (call finish() before the end); waiting for it", file=sys.stderr,
              flush=True)  # fmt: skip
    try:
        pending.wait(saver.timeout)
    except BaseException as exc:  # noqa: BLE001 - reported, the interpreter is exiting anyway
        print(f"labkit: WARNING: the checkpoint of step {pending.step} was NOT written: "
              f"{exc!r}", file=sys.stderr, flush=True)  # fmt: skip


def save_logical(root: str | Path, step: int, state: LogicalState, *, keep: int = 3,
                 group: dist.ProcessGroup | None = None) -> Path:  # fmt: skip
    """Synchronous :meth:`AsyncCheckpointer.save_logical`: returns on every rank once the
    checkpoint is committed (collective over ``group``)."""
    saver = AsyncCheckpointer(root, keep=keep, group=group, background=False)
    path = saver.save_logical(step, state).wait()
    if rank_and_size(group)[1] > 1:
        dist.barrier(group)  # nobody moves on until rank 0 has committed
    return path
