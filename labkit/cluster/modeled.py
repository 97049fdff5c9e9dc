"""The software link model's collectives (MODELED, not emulated): what a charged call costs, and
when it ends.

Torch's native ``all_reduce``, ``reduce_scatter_tensor``/``_single``,
``all_gather_into_tensor``/``_single``, ``all_gather`` and ``broadcast`` run at local speed, but
a call whose group spans several nodes ends no earlier than

    end = max over the group's ranks of (arrival) + cost

A collective cannot start before its last rank arrives (nothing moves until everyone has
something to send or somewhere to put it), so a rank that enters early waits for the late one
and then for the transfer, as on a real network; charging it from its own start would hide the
cost behind the wait. ``cost`` is the alpha-beta time of a flat ring over the group's ranks in
rank order, where a step is bounded by the busiest uplink (``k`` ring edges leave one node:
``k`` chunks share it)::

    all_reduce            2(p-1) * (alpha + k * D/p * beta)     D: the tensor's bytes
    reduce_scatter        (p-1)  * (alpha + k * D/p * beta)     D: the input's bytes
    all_gather            (p-1)  * (alpha + k * D/p * beta)     D: the output's bytes
    broadcast             (p-1) * alpha + k * D * beta          (a pipelined chain)

Arrivals travel through :class:`ArrivalBoard`, a file per group in the run folder (every rank
reads ``time.monotonic()``, one clock on one machine). Async collectives pay the end in
``wait()``. Collectives do not occupy the link clock of the point-to-point model (the two never
contend). Other collectives (barrier, all_to_all, reduce, gather, scatter) and functional
collectives (DTensor's) run uncharged, at local speed.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from labkit.cluster.spec import NodeTopology
from labkit.safe_files import open_shared_fd

__all__ = ["ArrivalBoard", "LateWork", "charged_collectives", "flat_ring_cost", "nbytes_of"]


class LateWork:
    """A work handle whose completion is ``real work done`` AND ``time.monotonic() >= until``.

    ``real`` may arrive later (a delayed send): ``_set`` hands it over from the dispatcher.
    ``until`` may be a function, called once when the real work is done (a charged collective's
    end needs every rank's arrival, known for sure only then)."""

    def __init__(self, real: Any = None, until: float | Callable[[], float] = 0.0):
        self.until = until
        self.real = real
        self.ready = threading.Event()
        self.error: BaseException | None = None
        if real is not None:
            self.ready.set()

    def _set(self, real: Any = None, error: BaseException | None = None) -> None:
        self.real, self.error = real, error
        self.ready.set()

    def _deadline(self) -> float:
        if callable(self.until):  # the real work is done: every rank has arrived
            self.until = self.until()
        return self.until

    def wait(self, timeout: Any = None) -> bool:
        self.ready.wait()
        if self.error is not None:
            raise self.error
        ok = self.real.wait() if timeout is None else self.real.wait(timeout)
        time.sleep(max(0.0, self._deadline() - time.monotonic()))
        return bool(ok) if ok is not None else True

    def is_completed(self) -> bool:
        if not self.ready.is_set():
            return False
        if self.error is not None:
            return True
        return bool(self.real.is_completed()) and time.monotonic() >= self._deadline()

    def is_success(self) -> bool:
        return self.is_completed() and self.error is None

    def result(self) -> Any:
        self.wait()
        return self.real.result()

    def get_future(self) -> torch.futures.Future:
        late: torch.futures.Future = torch.futures.Future()

        def finish() -> None:
            try:
                self.wait()
                late.set_result(self.real.get_future().value())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                late.set_exception(exc)

        threading.Thread(target=finish, daemon=True).start()
        return late


def flat_ring_cost(
    kind: str, nbytes: int, nodes_of_ranks: list[int], alpha: float, beta: float
) -> float:
    """Seconds a flat ring over ranks on ``nodes_of_ranks`` (in ring order) takes (module doc).
    0 when every rank sits on one node."""
    p = len(nodes_of_ranks)
    edges: dict[int, int] = {}
    for i, a in enumerate(nodes_of_ranks):
        if a != nodes_of_ranks[(i + 1) % p]:
            edges[a] = edges.get(a, 0) + 1
    if not edges:
        return 0.0
    k = max(edges.values())
    if kind == "all_reduce":
        return 2 * (p - 1) * (alpha + k * nbytes / p * beta)
    if kind in ("reduce_scatter", "all_gather"):
        return (p - 1) * (alpha + k * nbytes / p * beta)
    if kind == "broadcast":
        return (p - 1) * alpha + k * nbytes * beta
    raise ValueError(f"unknown collective kind {kind!r}")


class ArrivalBoard:
    """When each rank arrived at each charged collective, shared by the ranks through files.

    Calls on one group are made in the same order on every rank (as every collective
    requires), so the n-th charged call on a group is the same collective on every rank. Rank
    ``i`` of the group writes ``(n + 1, arrival)`` into slot ``n % SLOTS`` of row ``i`` of the
    group's file *before* it issues the real collective; once the real collective is done,
    every rank has arrived, so :meth:`arrive`'s function reads the row of each rank and returns
    the latest arrival. Each rank writes only its own row, so no lock is needed between
    processes. A slot already holding a later call (a rank ``SLOTS`` async calls ahead)
    means that rank arrived long before: it is left out. A slot not written yet (a broadcast's
    root can finish before a receiver arrives) is polled, up to ``POLL_S`` seconds.
    """

    SLOTS = 1024
    POLL_S = 30.0

    def __init__(self, prefix: Path, rank: int):
        self.prefix, self.rank = prefix, rank
        self.lock = threading.Lock()  # the threads of this rank: files and call counters
        self.files: dict[str, int] = {}  # group name -> file descriptor
        self.calls: dict[str, int] = {}  # group name -> charged calls so far

    def _file(self, name: str, p: int) -> int:
        fd = self.files.get(name)
        if fd is None:
            tag = hashlib.sha1(name.encode()).hexdigest()[:16]  # any group name, a safe file name
            path = self.prefix.with_name(f"{self.prefix.name}.arrivals.{tag}")
            fd = open_shared_fd(path)  # the run's folder, checked; no link followed
            if os.fstat(fd).st_size < 16 * p * self.SLOTS:  # growing to one size: never shrinks
                os.ftruncate(fd, 16 * p * self.SLOTS)
            self.files[name] = fd
        return fd

    def arrive(self, group: Any, ranks: list[int], now: float) -> Callable[[], float]:
        """Record this rank's arrival ``now`` at its next call on ``group`` (global ``ranks``
        in group order); return a function giving the group's last arrival at that call (call
        it after the real collective is done)."""
        name, p = str(group.group_name), len(ranks)
        with self.lock:
            fd = self._file(name, p)
            n = self.calls.get(name, 0)
            self.calls[name] = n + 1
        slot = n % self.SLOTS
        mine = 16 * (ranks.index(self.rank) * self.SLOTS + slot)
        os.pwrite(fd, struct.pack("dd", float(n + 1), now), mine)

        def last() -> float:
            latest, deadline = now, time.monotonic() + self.POLL_S
            for row in range(p):
                while True:
                    seq, at = struct.unpack("dd", os.pread(fd, 16, 16 * (row * self.SLOTS + slot)))
                    if seq >= n + 1 or time.monotonic() > deadline:
                        break
                    time.sleep(2e-4)  # not arrived yet
                if seq == n + 1:
                    latest = max(latest, at)
            return latest

        return last


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# name -> (kind, the bytes D of the module docstring from the bound arguments)
COLLECTIVES: dict[str, tuple[str, Callable[[dict[str, Any], int], int]]] = {
    "all_reduce": ("all_reduce", lambda a, p: nbytes_of(a["tensor"])),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, p: nbytes_of(a["input"])),
    "reduce_scatter_single": ("reduce_scatter", lambda a, p: nbytes_of(a["input"])),
    "all_gather_into_tensor": ("all_gather", lambda a, p: nbytes_of(a["output_tensor"])),
    "all_gather_single": ("all_gather", lambda a, p: nbytes_of(a["output_tensor"])),
    "all_gather": ("all_gather", lambda a, p: p * nbytes_of(a["tensor"])),
    "broadcast": ("broadcast", lambda a, p: nbytes_of(a["tensor"])),
}


def charged_collectives(
    topology: NodeTopology, alpha: float, beta: float, board: ArrivalBoard
) -> dict[str, Callable[..., Any]]:
    """The charged versions of torch's collectives of this process (name -> function)."""
    charging = threading.local()  # a charged collective calling another is charged once

    def charged(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        kind, size = COLLECTIVES[name]
        signature = inspect.signature(real)

        def collective(*args: Any, **kwargs: Any) -> Any:
            arrival = time.monotonic()
            if getattr(charging, "on", False):
                return real(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            pg = bound.arguments["group"]
            pg = c10d._get_default_group() if pg is None else pg
            if pg is dist.GroupMember.NON_GROUP_MEMBER:  # not ours: torch says so
                return real(*args, **kwargs)
            ranks = dist.get_process_group_ranks(pg)
            nbytes = size(bound.arguments, len(ranks))
            cost = flat_ring_cost(kind, nbytes, [topology.node_of(r) for r in ranks], alpha, beta)
            # written before the real call: a peer's real call ends only after ours began
            last = board.arrive(pg, ranks, arrival) if cost > 0.0 else None
            charging.on = True
            try:
                work = real(*args, **kwargs)
            finally:
                charging.on = False
            if last is None or (work is None and bound.arguments["async_op"]):
                return work
            end = last  # (for mypy: a narrowed name inside the lambda)
            if bound.arguments["async_op"]:
                return LateWork(work, lambda: end() + cost)
            time.sleep(max(0.0, end() + cost - time.monotonic()))
            return work

        collective.__name__ = collective.__qualname__ = name
        return collective

    return {name: charged(name, getattr(c10d, name)) for name in COLLECTIVES if hasattr(c10d, name)}
