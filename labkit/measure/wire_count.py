"""Count every message a rank puts on the wire: which op, over which ranks, how many bytes.

``with WireCounter() as wc: job.step(...)`` replaces, inside this rank and for the block only,
``torch.distributed``'s collectives (``all_reduce``, ``reduce_scatter_tensor`` / ``_single``,
``all_gather_into_tensor`` / ``_single``, ``all_gather``, ``broadcast``, ``all_to_all_single``)
and point-to-point entry points (``isend``, ``irecv``, ``send``, ``recv``) by wrappers that
append a :class:`Message` to ``wc.messages`` and call the function they replaced. Everything
is restored on exit, exceptions included. The names are replaced both on ``torch.distributed``
and on ``distributed_c10d``, as the emulated cluster's link model does
(:mod:`labkit.cluster.software`): ``P2POp`` checks its op against the c10d names, and
``batch_isend_irecv`` calls each op's function, so a batch (labkit's :func:`post`, the
pipeline executor's flush) is counted message by message. labkit's own collectives are
built from ``post``, so they are counted as the messages they send. Installed after the link
model, the counter wraps the model's wrappers: what it sees is what the model delays.

What a :class:`Message` holds (the payload, counted once per call on the calling rank):
``nbytes`` is the buffer the call names: an all-reduce's tensor, a reduce-scatter's full
input, an all-gather's full output, a broadcast's tensor, an all-to-all's input, a sent or
received tensor. :func:`wire_bytes` converts a payload into what a bandwidth-optimal (ring)
algorithm sends from the rank, the planner's unit (:func:`labkit.planner.space.wire_bytes`
lists buffers, ``steptime`` prices them as rings): ``2(p-1)/p`` of an all-reduce, ``(p-1)/p``
of a reduce-scatter, all-gather or all-to-all, the whole tensor of a broadcast (a chain: every
rank but the last forwards it) and of a send, nothing for a receive. That is the one place the
conversion happens.

Where a message came from: ``site`` is ``module:qualname`` of the first frame outside torch,
``labkit.collectives`` and the emulated cluster (the technique that asked); ``owner`` is the
``id`` of the :class:`~labkit.collectives.Comm` it went through (None: a direct call), so a
caller who knows which ``Comm`` serves what (a tensor-parallel block, the embedding) can name
it. Thread-safe: a lock guards the list (a DDP communication thread may send beside the main
thread), and a per-thread depth counts only the outermost wrapped call (``send`` built on
``isend``, ``all_gather_object`` on ``all_gather``, are one message each). Messages tagged
``CONTROL_TAG`` (labkit's cross-rank argument checks and the guard's settle,
:mod:`labkit.collectives.guard`) are not counted: they carry no payload.
"""

from __future__ import annotations

import functools
import sys
import threading
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from labkit.collectives.cost_model import busbw_factor
from labkit.collectives.primitives import CONTROL_TAG

__all__ = ["COLLECTIVES", "Message", "P2P", "WireCounter", "wire_bytes"]

# wrapped name -> (op recorded, the argument naming the payload, torch's parameter order)
COLLECTIVES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "all_reduce": ("all_reduce", "tensor", ("tensor", "op", "group")),
    "reduce_scatter_tensor": ("reduce_scatter", "input", ("output", "input", "op", "group")),
    "reduce_scatter_single": ("reduce_scatter", "input", ("output", "input", "op", "group")),
    "all_gather_into_tensor": ("all_gather", "output_tensor",
                               ("output_tensor", "input_tensor", "group")),
    "all_gather_single": ("all_gather", "output_tensor",
                          ("output_tensor", "input_tensor", "group")),
    "all_gather": ("all_gather", "tensor_list", ("tensor_list", "tensor", "group")),
    "broadcast": ("broadcast", "tensor", ("tensor", "src", "group")),
    "all_to_all_single": ("all_to_all", "input", ("output", "input", "output_split_sizes",
                                                  "input_split_sizes", "group")),
}  # fmt: skip
# point-to-point: (op recorded, torch's parameter order)
P2P: dict[str, tuple[str, tuple[str, ...]]] = {
    "isend": ("send", ("tensor", "dst", "group", "tag", "group_dst")),
    "send": ("send", ("tensor", "dst", "group", "tag", "group_dst")),
    "irecv": ("recv", ("tensor", "src", "group", "tag", "group_src")),
    "recv": ("recv", ("tensor", "src", "group", "tag", "group_src")),
}
_SKIP = ("torch", "labkit.collectives", "labkit.cluster", __name__)


@dataclass(frozen=True)
class Message:
    """One call on one rank: ``op`` (a key's value of :data:`COLLECTIVES` or "send"/"recv"),
    ``ranks`` (a collective's group, global ranks in group order; a point-to-point call's
    ``(source, destination)``, -1 for a receive from any source), the payload ``nbytes``
    (module docstring), the calling ``site`` and the ``Comm`` ``owner`` id (or None)."""

    op: str
    ranks: tuple[int, ...]
    nbytes: int
    site: str
    owner: int | None = None


def wire_bytes(msg: Message) -> float:
    """Bytes a ring (bandwidth-optimal) algorithm sends from the calling rank for ``msg``
    (module docstring): the planner's unit, converted here and nowhere else."""
    p = len(msg.ranks)
    if msg.op == "recv" or p == 1:
        return 0.0
    if msg.op == "send":
        return float(msg.nbytes)
    if msg.op == "all_to_all":  # every rank keeps its own piece: (p-1)/p leaves, as a gather
        return busbw_factor("all_gather", p) * msg.nbytes
    return busbw_factor(msg.op, p) * msg.nbytes  # nccl-tests' ring factors; unknown ops raise


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _origin() -> tuple[str, int | None]:
    """(site, owner) of the call being wrapped (module docstring)."""
    frame, owner = sys._getframe(2), None
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if owner is None and module == "labkit.collectives.comm":
            me = frame.f_locals.get("self")
            owner = id(me) if type(me).__name__ == "Comm" else None
        if not module.startswith(_SKIP):
            code = frame.f_code
            return f"{module}:{getattr(code, 'co_qualname', code.co_name)}", owner
        frame = frame.f_back  # type: ignore[assignment]
    return "?", owner


class WireCounter:
    """A context manager counting this rank's messages into ``messages`` (module docstring)."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self._lock = threading.Lock()
        self._depth = threading.local()
        self._saved: list[tuple[Any, str, Any]] = []
        self._ranks: dict[int, tuple[int, ...]] = {}

    def _group_ranks(self, group: Any) -> tuple[int, ...]:
        pg = group if group is not None else c10d._get_default_group()
        if id(pg) not in self._ranks:
            self._ranks[id(pg)] = tuple(dist.get_process_group_ranks(pg))
        return self._ranks[id(pg)]

    def _record(self, name: str, args: tuple, kwargs: dict[str, Any]) -> Message | None:
        site, owner = _origin()
        if name in P2P:
            op, params = P2P[name]
            named = {**dict(zip(params, args)), **kwargs}
            if named.get("tag") == CONTROL_TAG:  # labkit's argument checks and settles: no
                return None  # payload (a few int64 per call), so no message of the planner's
            peer, group_peer = named.get(params[1]), named.get(params[4])
            group = named.get("group") or c10d._get_default_group()
            if peer is None and group_peer is not None:
                peer = dist.get_global_rank(group, group_peer)
            me, other = dist.get_rank(), -1 if peer is None else int(peer)
            ranks = (me, other) if op == "send" else (other, me)
            return Message(op, ranks, _nbytes(named.get("tensor")), site, owner)
        op, payload, params = COLLECTIVES[name]
        named = {**dict(zip(params, args)), **kwargs}
        return Message(op, self._group_ranks(named.get("group")), _nbytes(named.get(payload)),
                       site, owner)  # fmt: skip

    def _wrap(self, name: str, real: Any) -> Any:
        @functools.wraps(real)
        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            msg = self._record(name, args, kwargs) if depth == 0 else None
            if msg is not None:
                with self._lock:
                    self.messages.append(msg)
            self._depth.n = depth + 1
            try:
                return real(*args, **kwargs)
            finally:
                self._depth.n = depth

        return counted

    def __enter__(self) -> WireCounter:
        for name in (*COLLECTIVES, *P2P):
            real = getattr(c10d, name, None)
            if real is None:  # an older torch without the *_single names
                continue
            fn = self._wrap(name, real)
            for module in (c10d, dist):
                self._saved.append((module, name, getattr(module, name, None)))
                setattr(module, name, fn)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        while self._saved:
            module, name, real = self._saved.pop()
            if real is None:
                delattr(module, name)
            else:
                setattr(module, name, real)
