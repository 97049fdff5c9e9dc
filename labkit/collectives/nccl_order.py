"""Would this order of point-to-point calls deadlock under NCCL? Record the calls, then decide.

gloo lets any order through, so a collective that is correct under gloo can still hang on
GPUs. NCCL's rules (NVIDIA/nccl#479), which this module models:

* ungrouped ``send``/``recv`` between two ranks run on one stream in issue order: each waits
  until the peer's matching call is reached. A rank that posts ``irecv`` from a peer and then
  ``isend`` to it, against a peer doing the same, waits forever: both streams start with a recv.
* the calls of one ``dist.batch_isend_irecv`` are launched together: inside a batch the order
  of sends and receives does not matter; sends to one peer still match its receives in order.

:func:`record_p2p` wraps ``dist.isend/irecv/send/recv/batch_isend_irecv`` while active and
logs every message a rank posts (``P2PCall``) and when a non-blocking one was waited on.
:func:`nccl_problems` takes every rank's log and returns what would go wrong (empty: safe):

1. an ungrouped receive from a peer still in flight when the rank posts a send to that peer
   (the irecv-then-isend exchange);
2. for every pair of ranks, a replay of NCCL's in-order matching of the calls between them:
   a point where neither can progress (both wait on a recv, or both on a send) is a deadlock;
   a grouped call matched with an ungrouped one is flagged too (PyTorch may run them on
   different NCCL communicators); so are calls left unmatched.

Pairs are replayed independently: a cycle through three ranks of blocking calls is not
modelled (gloo hangs on that one too, so the equality tests already catch it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["P2PCall", "record_p2p", "nccl_problems"]


@dataclass
class P2PCall:
    """One message posted by this rank. ``batch``: index of its ``batch_isend_irecv`` (or None)."""

    kind: str  # "send" or "recv"
    peer: int  # global rank
    numel: int
    batch: int | None
    blocking: bool
    done_before: int | None = None  # index of the first call posted after this one completed
    data: torch.Tensor | None = field(default=None, repr=False)  # a copy, for sends when asked
    tag: int = 0  # primitives.CONTROL_TAG: a check's row or a settle flag, not data


def _peer(group: Any, rank: int | None, group_rank: int | None) -> int:
    if rank is not None:
        return int(rank)
    if group_rank is None:
        return -1  # recv from any source
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


class _Waited:
    """A Work that notes, in the log, when the caller waited on it."""

    def __init__(self, work: Any, call: P2PCall, log: list[P2PCall]) -> None:
        self.work, self.call, self.log = work, call, log

    def wait(self, *args: Any) -> Any:
        out = self.work.wait(*args)
        if self.call.done_before is None:
            self.call.done_before = len(self.log)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


@contextlib.contextmanager
def record_p2p(log: list[P2PCall], copy_sends: bool = False) -> Iterator[list[P2PCall]]:
    """Append every point-to-point message this rank posts to ``log`` while active."""
    import torch.distributed.distributed_c10d as c10d

    names = ("isend", "irecv", "send", "recv", "batch_isend_irecv")
    originals = {name: getattr(c10d, name) for name in names}
    state = {"inside": False, "batches": 0}

    def note(
        kind: str, tensor: torch.Tensor, peer: int, batch: int | None, blocking: bool, tag: int
    ) -> P2PCall:
        data = tensor.detach().clone() if copy_sends and kind == "send" else None
        call = P2PCall(kind, peer, tensor.numel(), batch, blocking, data=data, tag=int(tag))
        log.append(call)
        return call

    def single(name: str) -> Callable[..., Any]:
        fn, blocking = originals[name], not name.startswith("i")
        kind = "send" if "send" in name else "recv"

        def wrapped(tensor: torch.Tensor, *args: Any, **kw: Any) -> Any:
            if state["inside"]:  # made by batch_isend_irecv, or recv calling irecv: logged already
                return fn(tensor, *args, **kw)
            peer = args[0] if args else kw.get("dst", kw.get("src"))
            group = args[1] if len(args) > 1 else kw.get("group")
            group_peer = kw.get("group_dst", kw.get("group_src"))
            tag = args[2] if len(args) > 2 else kw.get("tag", 0)
            call = note(kind, tensor, _peer(group, peer, group_peer), None, blocking, tag)
            state["inside"] = True
            try:
                out = fn(tensor, *args, **kw)
            finally:
                state["inside"] = False
            if blocking:
                call.done_before = len(log)
                return out
            return _Waited(out, call, log) if out is not None else out

        return wrapped

    def batch(ops: list[Any]) -> list[Any]:
        index = state["batches"]
        state["batches"] += 1
        calls = [
            note(
                "send" if op.op is wrapped_fns["isend"] or op.op is originals["isend"] else "recv",
                op.tensor,
                int(op.peer),
                index,
                False,
                op.tag,
            )
            for op in ops
        ]
        state["inside"] = True
        try:
            works = originals["batch_isend_irecv"](ops)
        finally:
            state["inside"] = False
        if len(works) != len(calls):  # NCCL: one Work for the whole batch
            return works
        return [_Waited(w, c, log) for w, c in zip(works, calls)]

    wrapped_fns: dict[str, Callable[..., Any]] = {n: single(n) for n in names[:4]}
    wrapped_fns["batch_isend_irecv"] = batch
    try:  # P2POp accepts only the functions c10d itself names isend/irecv: patch both places
        for name, fn in wrapped_fns.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)
        yield log
    finally:
        for name, fn in originals.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)


def _describe(call: P2PCall) -> str:
    how = (
        f"batch {call.batch}"
        if call.batch is not None
        else ("blocking" if call.blocking else "ungrouped")
    )
    return f"{call.kind} ({call.numel} elements, {how})"


def _in_flight_recv_problems(rank: int, log: list[P2PCall]) -> list[str]:
    problems = []
    for i, call in enumerate(log):
        if call.kind != "recv" or call.batch is not None or call.blocking:
            continue
        for j in range(i + 1, call.done_before if call.done_before is not None else len(log)):
            later = log[j]
            if later.kind == "send" and later.peer == call.peer:
                problems.append(
                    f"rank {rank} posted an ungrouped irecv from rank {call.peer} (call {i}) and "
                    f"then a send to it (call {j}) before the receive completed: deadlocks on NCCL "
                    "against a peer doing the same; post both in one batch_isend_irecv"
                )
                break
    return problems


def _items(log: list[P2PCall], peer: int) -> list[list[P2PCall]]:
    """The calls towards ``peer`` in issue order; one batch's calls form one item."""
    items: list[list[P2PCall]] = []
    for call in log:
        if call.peer != peer:
            continue
        if call.batch is not None and items and items[-1][0].batch == call.batch:
            items[-1].append(call)
        else:
            items.append([call])
    return items


def _replay_pair(a: int, b: int, logs: list[list[P2PCall]]) -> list[str]:
    """NCCL's in-order matching of the calls between ranks a and b."""
    sides = [_items(logs[a], b), _items(logs[b], a)]
    pos = [0, 0]
    heads: list[list[P2PCall]] = [[], []]
    problems: list[str] = []
    while True:
        for s in (0, 1):
            while not heads[s] and pos[s] < len(sides[s]):
                heads[s] = list(sides[s][pos[s]])
                pos[s] += 1
        if not heads[0] and not heads[1]:
            return problems
        matched = False
        for kind, other in (("send", "recv"), ("recv", "send")):
            x = next((c for c in heads[0] if c.kind == kind), None)
            y = next((c for c in heads[1] if c.kind == other), None)
            if x is None or y is None:
                continue
            if (x.batch is None) != (y.batch is None):
                problems.append(
                    f"ranks {a} and {b}: rank {a}'s {_describe(x)} matches rank {b}'s "
                    f"{_describe(y)}: grouped against ungrouped"
                )
            if x.numel != y.numel:
                problems.append(
                    f"ranks {a} and {b}: a send of {x.numel if kind == 'send' else y.numel}"
                    f" elements meets a receive of {y.numel if kind == 'send' else x.numel}"
                )
            heads[0].remove(x)
            heads[1].remove(y)
            matched = True
        if not matched:
            waits = [" + ".join(_describe(c) for c in h) or "nothing" for h in heads]
            problems.append(
                f"ranks {a} and {b} deadlock under NCCL: rank {a} waits on {waits[0]} while "
                f"rank {b} waits on {waits[1]}"
            )
            return problems


def nccl_problems(logs: list[list[P2PCall]]) -> list[str]:
    """Every way the recorded calls (``logs[r]``: global rank r's) would go wrong under NCCL."""
    problems: list[str] = []
    for rank, log in enumerate(logs):
        problems += _in_flight_recv_problems(rank, log)
    for a in range(len(logs)):
        for b in range(a + 1, len(logs)):
            problems += _replay_pair(a, b, logs)
    return problems
