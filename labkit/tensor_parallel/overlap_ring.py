"""The communication of the overlapped tensor-parallel matmuls (``overlap.py``): ring steps.

A decomposed all-gather or reduce-scatter moves one sequence chunk per step around the ring of
the tp group: rank r sends to r + 1 and receives from r - 1. :class:`RingSteps` is that and
nothing else, so ``overlap.py`` reads as the algorithm alone:

* ``start(step, sends, recvs)`` posts one step's messages as ONE ``batch_isend_irecv``
  (:func:`labkit.collectives.common.post`), the order NCCL cannot deadlock on (ungrouped
  ``irecv`` then ``isend`` between two ranks, against a peer doing the same, waits forever:
  NVIDIA/nccl#479); ``tests/test_tp_overlap.py`` records every call to prove it.
* ``wait(step)`` completes them. Invariant: at most one step is in flight, so a buffer handed
  to ``start`` may be reused after the next ``wait``.
* ``drain()`` (the context manager's exit, on every path) waits for whatever is still posted:
  no message of a call outlives it, so an exception half-way leaves the group usable for the
  next call. (A failing *compute* step is :mod:`labkit.collectives.guard`'s business, used by
  ``overlap.py``: the schedule goes on, then every rank raises.)

:class:`Timeline` records when each step was posted, computed and waited (perf_counter
seconds), for the picture in ``labkit.viz.tp_overlap``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
from torch.distributed import ProcessGroup

from labkit.collectives.common import post, ring_neighbours

__all__ = ["RingSteps", "Timeline"]


@dataclass
class Timeline:
    """``events``: ``(phase, step, what, perf_counter seconds)``; ``what`` is one of "post",
    "compute", "computed", "waited"; ``phase`` names the call ("ag_fwd", "rs_fwd", ...)."""

    events: list[tuple[str, int, str, float]] = field(default_factory=list)

    def mark(self, phase: str, step: int, what: str) -> None:
        self.events.append((phase, step, what, time.perf_counter()))


class RingSteps:
    """One decomposed collective's messages on the ring of ``group``, one batch per step."""

    def __init__(
        self, group: ProcessGroup | None, phase: str = "", timeline: Timeline | None = None
    ) -> None:
        self.rank, self.size, self.right, self.left = ring_neighbours(group)
        self.group, self.phase, self.timeline = group, phase, timeline
        self._works: list[Any] = []

    def mark(self, step: int, what: str) -> None:
        if self.timeline is not None:
            self.timeline.mark(self.phase, step, what)

    def start(self, step: int, sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> None:
        """Post ``sends`` (to rank + 1) and ``recvs`` (from rank - 1) as one batch."""
        if self._works:
            raise RuntimeError("RingSteps.start: the previous step was not waited for")
        recv_w, send_w = post(
            [(s, self.right) for s in sends], [(r, self.left) for r in recvs], self.group
        )
        self._works = recv_w + send_w
        self.mark(step, "post")

    def wait(self, step: int) -> None:
        """Complete the step in flight (wait once per handle: a second wait on a gloo p2p
        handle hung in ``context_parallel/ring.py``)."""
        works, self._works = self._works, []
        for work in works:
            work.wait()
        self.mark(step, "waited")

    def drain(self) -> None:
        """Wait for every message still posted, even if one wait raises (then re-raise)."""
        works, self._works = self._works, []
        error: BaseException | None = None
        for work in works:
            try:
                work.wait()
            except BaseException as exc:  # noqa: BLE001 - keep draining, report the first
                error = error or exc
        if error is not None:
            raise error

    def __enter__(self) -> RingSteps:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is None:
            self.drain()
            return
        with contextlib.suppress(BaseException):  # the original exception is the one to see
            self.drain()
