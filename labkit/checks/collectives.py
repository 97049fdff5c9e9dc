"""Check for exercise 02 (the ring): the learner's reduce-scatter and all-gather on 3 ranks.

Contract checked (the same as :mod:`labkit.collectives.ring`, SUM only, flat 1-D tensors):

* ``reduce_scatter(output_shard, input_full, group=None)``: ``output_shard`` receives chunk
  ``rank`` of the sum over ranks, chunks laid out like ``input_full.tensor_split(world_size)``;
* ``all_gather(output_full, input_shard, group=None)``: the inverse;
* ``all_reduce(tensor, group=None)`` (optional): in place.

How a mismatch is explained: the first run uses *labelled* float32 data whose every partial
sum spells out which ranks' data it holds, from which index (``ring_explain.py`` decodes it).
The check records every message each rank sends (by wrapping ``dist.send``/``isend`` for
the duration of the check), so it can show, step by step, which chunk a rank sent, with whose
data, next to what the ring sends at that step; it switches torch's collectives off meanwhile.
Then random data in float32, bfloat16 and float16, on odd sizes and on a size smaller than
the world, is compared within ``world_size * eps`` of the exact sum (a ring rounds at each hop).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from labkit.checks.core import CheckFailed, compare, launch_check, passed
from labkit.checks.ring_explain import explain_labelled, labels, message_problem
from labkit.collectives.common import chunk_offsets
from labkit.collectives.nccl_order import P2PCall, record_p2p
from labkit.launch import JobTimeoutError, RankFailedError

LABEL_SIZES = (6, 7, 2)  # even chunks first (schedule bugs), then [3, 2, 2], then [1, 1, 0]
SIZES = (1, 2, 7, 1001)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


NATIVE = (
    "all_reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "broadcast",
    "reduce",
    "all_to_all",
    "all_to_all_single",
    "scatter",
    "gather",
    "all_reduce_coalesced",
)


class NativeCollectiveUsed(RuntimeError):
    """The learner's ring called one of torch's collectives instead of sending messages."""


@contextlib.contextmanager
def _no_native_collectives() -> Iterator[None]:
    """Make torch's collectives raise while active (the check's own calls run outside it)."""
    import torch.distributed.distributed_c10d as c10d

    originals = {name: getattr(c10d, name) for name in NATIVE if hasattr(c10d, name)}

    def refuse(name: str) -> Callable[..., Any]:
        def refused(*args: Any, **kwargs: Any) -> Any:
            raise NativeCollectiveUsed(
                f"dist.{name} is switched off during this check: the exercise is to build the "
                "ring from point-to-point messages (dist.isend/irecv/send/recv or "
                "dist.batch_isend_irecv), not to call torch's collective and slice its result"
            )

        return refused

    try:
        for name in originals:
            setattr(c10d, name, refuse(name))
            setattr(dist, name, refuse(name))
        yield
    finally:
        for name, fn in originals.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)


@contextlib.contextmanager
def _record_sends(log: list[tuple[int, torch.Tensor]]) -> Iterator[None]:
    """Log ``(dst, copy of data)`` of every send while active; no native collective allowed."""
    calls: list[P2PCall] = []
    with _no_native_collectives(), record_p2p(calls, copy_sends=True):
        yield
    # data messages only: integer messages are argument checks (labkit's own ring validates)
    log += [
        (c.peer, c.data)
        for c in calls
        if c.kind == "send" and c.data is not None and c.data.is_floating_point()
    ]


def _on_rank(
    rs: Callable[..., Any], ag: Callable[..., Any], ar: Callable[..., Any] | None
) -> dict[str, Any]:
    rank, p = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {"labelled": [], "random": []}
    for n in LABEL_SIZES:
        lo, hi = chunk_offsets(n, p)[rank : rank + 2]
        sends: list[tuple[int, torch.Tensor]] = []
        shard = torch.full((hi - lo,), float("nan"))
        with _record_sends(sends):
            rs(shard, labels(n, rank))
        full = torch.full((n,), float("nan"))
        ag_sends: list[tuple[int, torch.Tensor]] = []
        with _record_sends(ag_sends):
            ag(full, labels(n, rank)[lo:hi].clone())
        out["labelled"].append((n, shard, sends, full, ag_sends))
        # stop at the first wrong labelled case (it is the one worth explaining), all ranks together
        want_shard = torch.stack([labels(n, r) for r in range(p)]).sum(0)[lo:hi]
        want_full = torch.cat(
            [labels(n, r)[chunk_offsets(n, p)[r] : chunk_offsets(n, p)[r + 1]] for r in range(p)]
        )
        ok = shard.shape == want_shard.shape and full.shape == want_full.shape
        ok = ok and torch.equal(shard, want_shard) and torch.equal(full, want_full)
        wrong = torch.tensor([0.0 if ok else 1.0])
        dist.all_reduce(wrong)
        if wrong.item():
            return out
    for case, (n, dtype) in enumerate((n, d) for d in DTYPES for n in SIZES):
        xs = [
            torch.randn(n, generator=torch.Generator().manual_seed(case * 10 + r)).to(dtype)
            for r in range(p)
        ]
        lo, hi = chunk_offsets(n, p)[rank : rank + 2]
        shard = torch.full((hi - lo,), float("nan"), dtype=dtype)
        full = torch.full((n,), float("nan"), dtype=dtype)
        reduced = None
        with _no_native_collectives():
            rs(shard, xs[rank].clone())
            ag(full, xs[rank][lo:hi].clone())
            if ar is not None:
                reduced = xs[rank].clone()
                ar(reduced)
        out["random"].append((n, dtype, xs, shard, full, reduced))
    return out


def check_ring(
    reduce_scatter: Callable[..., Any],
    all_gather: Callable[..., Any],
    all_reduce: Callable[..., Any] | None = None,
    world_size: int = 3,
) -> None:
    """Run the learner's ring collectives on ``world_size`` ranks; CheckFailed says what's wrong."""
    p = world_size
    try:
        results = launch_check(
            _on_rank,
            reduce_scatter,
            all_gather,
            all_reduce,
            world_size=p,
            quiet=True,
            timeout=60,
            backend="gloo",
        )
    except RankFailedError as exc:
        if exc.exc_type == "NotImplementedError":
            raise
        if exc.exc_type == NativeCollectiveUsed.__name__:
            raise CheckFailed(f"rank {exc.rank}: {exc.exc_message}") from None
        raise CheckFailed(
            f"rank {exc.rank} failed ({exc.exc_type}: {exc.exc_message.splitlines()[0][:200]}).\n"
            "  When a rank is killed inside gloo (ProcessDied, SIGABRT) it received a message "
            "larger than the "
            "buffer it posted: a send and its matching receive disagree on the number of "
            "elements. Chunk c of n "
            f"elements is input.tensor_split({p})[c]: for n = 7 the chunks have [3, 2, 2] "
            "elements, for n = 2 "
            "[1, 1, 0]. Receive chunk c into a buffer the size of chunk c, and send the chunk the "
            "schedule names."
        ) from None
    except JobTimeoutError:
        raise CheckFailed(
            "the ranks waited on each other until the 60 s timeout: a receive that no rank sends "
            "to, or two ranks "
            "that both block in dist.send/recv before the other posts its half. Post each step's "
            "receive and send "
            "together (batch_isend_irecv, or irecv + isend then wait on both)."
        ) from None
    problem = explain_labelled(results, p)
    if problem:
        raise CheckFailed(problem)
    if len(results[0]["labelled"]) < len(LABEL_SIZES):
        raise CheckFailed("a labelled case failed on some rank but could not be explained")
    problem = message_problem(results, p)
    if problem:
        raise CheckFailed(problem)
    for case in range(len(results[0]["random"])):
        n, dtype, xs, _, _, _ = results[0]["random"][case]
        exact = torch.stack([x.double() for x in xs]).sum(0)
        eps = torch.finfo(dtype).eps
        spread = torch.stack([x.double().abs() for x in xs]).sum(0)  # bound of a p-term sum's error
        tol = {"rtol": p * eps, "atol": p * eps * (float(spread.max()) if n else 0.0)}
        for rank, res in enumerate(results):
            _, _, _, shard, full, reduced = res["random"][case]
            lo, hi = chunk_offsets(n, p)[rank : rank + 2]
            what = f"{dtype}, {n} elements, rank {rank}"
            gathered = torch.cat(
                [xs[r][chunk_offsets(n, p)[r] : chunk_offsets(n, p)[r + 1]] for r in range(p)]
            )
            for problem in (
                compare(
                    exact[lo:hi].to(dtype),
                    shard,
                    what=f"reduce_scatter, {what}'s shard (chunk {rank})",
                    **tol,
                ),
                compare(gathered, full, what=f"all_gather, {what}'s output", atol=0, rtol=0),
                compare(exact.to(dtype), reduced, what=f"all_reduce, {what}", **tol)
                if reduced is not None
                else None,
            ):
                if problem:
                    raise CheckFailed(
                        f"{problem}. (Tolerance: {p} x the dtype's epsilon of the exact sum.)"
                    )
    done = "reduce-scatter, all-gather" + (" and all-reduce" if all_reduce is not None else "")
    passed(
        f"your ring {done} match on {p} ranks: sizes {sorted(set(LABEL_SIZES + SIZES))}, dtypes "
        "float32/bfloat16/float16"
    )
