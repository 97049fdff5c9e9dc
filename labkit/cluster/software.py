"""The software link model: slow inter-node links without root, inside each rank.

:func:`install` (called by the launch right after ``init_process_group``) replaces
``torch.distributed``'s point-to-point and collective entry points of this process. Techniques
call ``dist.isend`` / ``dist.batch_isend_irecv`` / ``dist.all_reduce`` as always and simply see
a slower network between nodes. Inside a node nothing changes.

Point-to-point (EMULATED, message by message). Each node has one uplink and one downlink,
shared by its ranks. A file per run holds, per node, the time until which each link is busy
(``time.monotonic()``, one clock for all processes), read and written under a lock: a
thread lock, then an ``fcntl`` lock (:class:`LinkClock` says why both).
A message of ``n`` bytes from node a to node b, issued at ``now``::

    start   = max(now, uplink_busy[a], downlink_busy[b])   # wait for both links to be free
    uplink_busy[a] = downlink_busy[b] = start + n * beta   # the links carry it for n*beta s
    arrival = start + n * beta + alpha                     # alpha: per-message latency

with ``beta = 1 / inter_bandwidth``, ``alpha = inter_latency``. The real send is issued at
``arrival`` by a dispatcher thread of the sending rank (in arrival order), so the receiver gets
the bytes when the model says they arrive; the sender's ``wait()`` returns after that. Nothing
blocks at issue time: async sends overlap with compute as on a real network. A rank's messages
to one peer keep their order (their arrivals are increasing). Receives are untouched.

Collectives (MODELED, not emulated; :mod:`labkit.cluster.modeled`). Torch's native collectives
whose group spans several nodes run at local speed but end no earlier than the last rank's
arrival plus the alpha-beta cost of a flat ring over the group; async ones pay it in ``wait()``.
"""

from __future__ import annotations

import contextlib
import fcntl
import heapq
import itertools
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from labkit.cluster.modeled import (
    ArrivalBoard,
    LateWork,
    charged_collectives,
    flat_ring_cost,
    nbytes_of,
)
from labkit.cluster.spec import EmulatedCluster, NodeTopology
from labkit.safe_files import open_shared_fd

__all__ = ["LinkClock", "flat_ring_cost", "install", "reserve"]  # flat_ring_cost: re-exported


def reserve(
    up: float, down: float, now: float, nbytes: int, alpha: float, beta: float
) -> tuple[float, float]:
    """Pure core of the link model: ``(busy_until, arrival)`` of one message (see module)."""
    busy_until = max(now, up, down) + nbytes * beta
    return busy_until, busy_until + alpha


class LinkClock:
    """Per-node uplink/downlink busy-until times, shared by every rank through one file.

    Two locks, because an ``fcntl`` lock belongs to the *process*: it excludes the other ranks,
    but a second thread of the same rank (DDP's communication thread beside the main thread,
    or two async sends) would take it again at once and both would read the same busy time,
    losing a reservation. ``self.lock`` excludes the threads of this process, the fcntl lock
    taken inside it the other processes.
    """

    def __init__(self, path: Path, nodes: int):
        self.nodes = nodes
        self.lock = threading.Lock()
        self.fd = open_shared_fd(path)  # the run's folder, checked; no link followed
        with self._locked():
            if os.fstat(self.fd).st_size < 16 * nodes:  # the first rank here zeroes it
                os.pwrite(self.fd, bytes(16 * nodes), 0)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self.lock:  # this process's threads first, then the other processes
            fcntl.lockf(self.fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.lockf(self.fd, fcntl.LOCK_UN)

    def send(self, src: int, dst: int, nbytes: int, alpha: float, beta: float) -> float:
        """Reserve node ``src``'s uplink and ``dst``'s downlink; return the arrival time."""
        with self._locked():
            (up,) = struct.unpack("d", os.pread(self.fd, 8, 8 * src))
            (down,) = struct.unpack("d", os.pread(self.fd, 8, 8 * (self.nodes + dst)))
            busy, arrival = reserve(up, down, time.monotonic(), nbytes, alpha, beta)
            os.pwrite(self.fd, struct.pack("d", busy), 8 * src)
            os.pwrite(self.fd, struct.pack("d", busy), 8 * (self.nodes + dst))
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


def install(cluster: EmulatedCluster, topology: NodeTopology, state: Path) -> None:
    """Put the link model of ``cluster`` into this rank (after ``init_process_group``)."""
    alpha, beta = float(cluster.inter_latency), 1.0 / float(cluster.inter_bandwidth)
    clock = LinkClock(state, topology.nodes)
    dispatcher = _Dispatcher()
    dispatcher.start()
    me = topology.node_of(dist.get_rank())
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
        work = LateWork()
        arrival = clock.send(me, there, nbytes_of(tensor), alpha, beta)

        def go() -> None:
            try:  # the ProcessGroup itself: no Python-level state of c10d is touched
                work._set(pg.send([tensor], dist.get_group_rank(pg, peer), tag))
            except BaseException as exc:  # noqa: BLE001 - raised in the sender's wait()
                work._set(error=exc)

        dispatcher.schedule(arrival, go)
        return work

    def send(tensor, dst=None, group=None, tag=0, group_dst=None) -> None:  # noqa: ANN001
        isend(tensor, dst, group, tag, group_dst).wait()

    board = ArrivalBoard(state, dist.get_rank())  # arrivals at charged collectives
    patches: dict[str, Any] = {"isend": isend, "send": send}
    patches.update(charged_collectives(topology, alpha, beta, board))
    isend.__name__ = "isend"  # P2POp and batch_isend_irecv name ops in their messages
    for name, fn in patches.items():
        setattr(c10d, name, fn)
        setattr(dist, name, fn)
