"""The software link model: slow inter-node links without root, inside each rank.

:func:`install` (called by the launch right after ``init_process_group``) replaces
``torch.distributed``'s point-to-point and collective entry points of this process. Techniques
call ``dist.isend`` / ``dist.batch_isend_irecv`` / ``dist.all_reduce`` as always and simply see
a slower network between nodes. Inside a node nothing changes.

Point-to-point (EMULATED, message by message). Each node has one uplink and one downlink,
shared by its ranks. A file per run holds, per node, the time until which each link is busy
(``time.monotonic()``, one clock for all processes), read and written under an ``fcntl`` lock.
A message of ``n`` bytes from node a to node b, issued at ``now``::

    start   = max(now, uplink_busy[a], downlink_busy[b])   # wait for both links to be free
    uplink_busy[a] = downlink_busy[b] = start + n * beta   # the links carry it for n*beta s
    arrival = start + n * beta + alpha                     # alpha: per-message latency

with ``beta = 1 / inter_bandwidth``, ``alpha = inter_latency``. The real send is issued at
``arrival`` by a dispatcher thread of the sending rank (in arrival order), so the receiver gets
the bytes when the model says they arrive; the sender's ``wait()`` returns after that. Nothing
blocks at issue time: async sends overlap with compute as on a real network. A rank's messages
to one peer keep their order (their arrivals are increasing). Receives are untouched.

Collectives (MODELED, not emulated). Torch's native ``all_reduce``, ``reduce_scatter_tensor``/
``_single``, ``all_gather_into_tensor``/``_single``, ``all_gather`` and ``broadcast`` run at
local speed, but a call whose group spans several nodes completes no earlier than ``issue +
cost``, the alpha-beta time of a flat ring over the group's ranks in rank order, where a step
is bounded by the busiest uplink (``k`` ring edges leave one node: ``k`` chunks share it)::

    all_reduce            2(p-1) * (alpha + k * D/p * beta)     D: the tensor's bytes
    reduce_scatter        (p-1)  * (alpha + k * D/p * beta)     D: the input's bytes
    all_gather            (p-1)  * (alpha + k * D/p * beta)     D: the output's bytes
    broadcast             (p-1) * alpha + k * D * beta          (a pipelined chain)

Async collectives pay it in ``wait()``. Collectives do not occupy the link clock of the
point-to-point model (the two never contend). Other collectives (barrier, all_to_all, reduce,
gather, scatter) and functional collectives (DTensor's) run uncharged, at local speed.
"""

from __future__ import annotations

import fcntl
import heapq
import inspect
import itertools
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

from labkit.cluster.spec import EmulatedCluster, NodeTopology


def reserve(
    up: float, down: float, now: float, nbytes: int, alpha: float, beta: float
) -> tuple[float, float]:
    """Pure core of the link model: ``(busy_until, arrival)`` of one message (see module)."""
    busy_until = max(now, up, down) + nbytes * beta
    return busy_until, busy_until + alpha


class LinkClock:
    """Per-node uplink/downlink busy-until times, shared by every rank through one file."""

    def __init__(self, path: Path, nodes: int):
        self.nodes = nodes
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.lockf(self.fd, fcntl.LOCK_EX)
        try:
            if os.fstat(self.fd).st_size < 16 * nodes:  # the first rank here zeroes it
                os.pwrite(self.fd, bytes(16 * nodes), 0)
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN)

    def send(self, src: int, dst: int, nbytes: int, alpha: float, beta: float) -> float:
        """Reserve node ``src``'s uplink and ``dst``'s downlink; return the arrival time."""
        fcntl.lockf(self.fd, fcntl.LOCK_EX)
        try:
            (up,) = struct.unpack("d", os.pread(self.fd, 8, 8 * src))
            (down,) = struct.unpack("d", os.pread(self.fd, 8, 8 * (self.nodes + dst)))
            busy, arrival = reserve(up, down, time.monotonic(), nbytes, alpha, beta)
            os.pwrite(self.fd, struct.pack("d", busy), 8 * src)
            os.pwrite(self.fd, struct.pack("d", busy), 8 * (self.nodes + dst))
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN)
        return arrival


class _Dispatcher(threading.Thread):
    """Runs each scheduled real send at its due time, earliest first (ties in issue order)."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="labkit-link-model")
        self.cv = threading.Condition()
        self.heap: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = itertools.count()

    def schedule(self, due: float, action: Callable[[], None]) -> None:
        with self.cv:
            heapq.heappush(self.heap, (due, next(self.seq), action))
            self.cv.notify()

    def run(self) -> None:
        while True:
            with self.cv:
                while not self.heap or self.heap[0][0] > time.monotonic():
                    wait = self.heap[0][0] - time.monotonic() if self.heap else None
                    self.cv.wait(wait)
                _, _, action = heapq.heappop(self.heap)
            action()


class _LateWork:
    """A work handle whose completion is ``real work done`` AND ``time.monotonic() >= until``.

    ``real`` may arrive later (a delayed send): ``_set`` hands it over from the dispatcher."""

    def __init__(self, real: Any = None, until: float = 0.0):
        self.until = until
        self.real = real
        self.ready = threading.Event()
        self.error: BaseException | None = None
        if real is not None:
            self.ready.set()

    def _set(self, real: Any = None, error: BaseException | None = None) -> None:
        self.real, self.error = real, error
        self.ready.set()

    def wait(self, timeout: Any = None) -> bool:
        self.ready.wait()
        if self.error is not None:
            raise self.error
        ok = self.real.wait() if timeout is None else self.real.wait(timeout)
        time.sleep(max(0.0, self.until - time.monotonic()))
        return bool(ok) if ok is not None else True

    def is_completed(self) -> bool:
        return (
            self.ready.is_set()
            and (self.error is not None or self.real.is_completed())
            and time.monotonic() >= self.until
        )

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


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# name -> (kind, the bytes D of the module docstring from the bound arguments)
_COLLECTIVES: dict[str, tuple[str, Callable[[dict[str, Any], int], int]]] = {
    "all_reduce": ("all_reduce", lambda a, p: _nbytes(a["tensor"])),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, p: _nbytes(a["input"])),
    "reduce_scatter_single": ("reduce_scatter", lambda a, p: _nbytes(a["input"])),
    "all_gather_into_tensor": ("all_gather", lambda a, p: _nbytes(a["output_tensor"])),
    "all_gather_single": ("all_gather", lambda a, p: _nbytes(a["output_tensor"])),
    "all_gather": ("all_gather", lambda a, p: p * _nbytes(a["tensor"])),
    "broadcast": ("broadcast", lambda a, p: _nbytes(a["tensor"])),
}


def install(cluster: EmulatedCluster, topology: NodeTopology, state: Path) -> None:
    """Put the link model of ``cluster`` into this rank (after ``init_process_group``)."""
    alpha, beta = float(cluster.inter_latency), 1.0 / float(cluster.inter_bandwidth)
    clock = LinkClock(state, topology.nodes)
    dispatcher = _Dispatcher()
    dispatcher.start()
    me = topology.node_of(dist.get_rank())
    charging = threading.local()  # a charged collective calling another is charged once
    real_isend = c10d.isend

    def isend(tensor, dst=None, group=None, tag=0, group_dst=None):  # noqa: ANN001, ANN202
        pg = group if group is not None else c10d._get_default_group()
        if (dst is None) == (group_dst is None):  # torch's own error message
            return real_isend(tensor, dst, group, tag, group_dst)
        peer = dst if group_dst is None else dist.get_global_rank(pg, group_dst)
        there = topology.node_of(peer)
        if there == me:
            return real_isend(tensor, group=pg, tag=tag, group_dst=dist.get_group_rank(pg, peer))
        if tensor.is_complex():
            tensor = torch.view_as_real(tensor)
        work = _LateWork()
        arrival = clock.send(me, there, _nbytes(tensor), alpha, beta)

        def go() -> None:
            try:  # the ProcessGroup itself: no Python-level state of c10d is touched
                work._set(pg.send([tensor], dist.get_group_rank(pg, peer), tag))
            except BaseException as exc:  # noqa: BLE001 - raised in the sender's wait()
                work._set(error=exc)

        dispatcher.schedule(arrival, go)
        return work

    def send(tensor, dst=None, group=None, tag=0, group_dst=None) -> None:  # noqa: ANN001
        isend(tensor, dst, group, tag, group_dst).wait()

    def charged(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        kind, size = _COLLECTIVES[name]
        signature = inspect.signature(real)

        def collective(*args: Any, **kwargs: Any) -> Any:
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
            until = time.monotonic() + cost
            charging.on = True
            try:
                work = real(*args, **kwargs)
            finally:
                charging.on = False
            if cost == 0.0 or (work is None and bound.arguments["async_op"]):
                return work
            if bound.arguments["async_op"]:
                return _LateWork(work, until)
            time.sleep(max(0.0, until - time.monotonic()))
            return work

        collective.__name__ = collective.__qualname__ = name
        return collective

    patches: dict[str, Any] = {"isend": isend, "send": send}
    for name in _COLLECTIVES:
        if hasattr(c10d, name):
            patches[name] = charged(name, getattr(c10d, name))
    isend.__name__ = "isend"  # P2POp and batch_isend_irecv name ops in their messages
    for name, fn in patches.items():
        setattr(c10d, name, fn)
        setattr(dist, name, fn)
