"""Check for exercise 16: the learner's all-to-all dispatch of expert parallelism.

Contract::

    arrived, recv_counts = dispatch(rows, counts, group=None)

``rows`` (M, d): this rank's token rows sorted by expert, ``counts`` (E,) int64 rows per
expert, ``E = p * local`` with rank q holding experts ``[q local, (q+1) local)``. Returns
``recv_counts`` (p, local) int64, ``recv_counts[r, e]`` = rows rank r sends for my local
expert e, and ``arrived`` (sum of recv_counts, d): rank 0's rows for my experts, then rank 1's,
..., each in the order its sender sorted them.

The harness runs on 3 ranks, 6 experts, with rank-dependent routing: a rank that sends some
rank nothing, a rank with no rows at all, uneven sizes. Rows are labelled (``1000 * rank +
row``) so a wrong row is named. torch's collectives are switched off (build it from
point-to-point messages, as in exercise 02), and it rejects, with the reason:

* moving more than the rows other ranks need (an all-gather of every token sends every row
  to every rank: ``p - 1`` times the bytes; the all-to-all sends each row once, and only to
  the rank holding its expert, keeping its own rows local);
* message orders that NCCL would deadlock on (:func:`labkit.collectives.nccl_order.nccl_problems`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from labkit.checks.collectives import NativeCollectiveUsed, _no_native_collectives
from labkit.checks.core import CheckFailed, compare, launch_check, passed
from labkit.collectives.nccl_order import P2PCall, nccl_problems, record_p2p
from labkit.launch import JobTimeoutError, RankFailedError

__all__ = ["CASES", "check_dispatch", "dispatch_on_rank", "expected_dispatch", "judge_dispatch"]

P, LOCAL, D = 3, 2, 3
# CASES[case][src] = rows src routes to each of the 6 experts (experts 2q, 2q+1 on rank q)
CASES = (
    ((2, 1, 0, 3, 1, 1), (0, 2, 2, 0, 1, 0), (1, 0, 1, 1, 0, 0)),  # rank 2 sends rank 2 nothing
    ((0, 0, 0, 0, 0, 0), (3, 0, 0, 1, 0, 2), (0, 1, 0, 0, 4, 0)),  # rank 0 has no tokens at all
)


def _rows(case: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.tensor(CASES[case][rank], dtype=torch.int64)
    n = int(counts.sum())
    rows = (1000.0 * rank + torch.arange(n, dtype=torch.float32))[:, None].repeat(1, D)  # (n, D)
    return rows, counts


def expected_dispatch(case: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What rank ``rank`` must receive in ``case``: (arrived, recv_counts)."""
    mine = slice(rank * LOCAL, (rank + 1) * LOCAL)
    parts, recv = [], []
    for src in range(P):
        rows, counts = _rows(case, src)
        start = int(counts[: rank * LOCAL].sum())
        take = int(counts[mine].sum())
        parts.append(rows[start : start + take])
        recv.append(counts[mine])
    return torch.cat(parts), torch.stack(recv)


def dispatch_on_rank(dispatch: Callable[..., Any]) -> dict[str, Any]:
    """On each of 3 ranks: the learner's results for every case, and the messages it posted."""
    rank = dist.get_rank()
    out: dict[str, Any] = {"results": [], "log": []}
    log: list[P2PCall] = []
    for case in range(len(CASES)):
        rows, counts = _rows(case, rank)
        with _no_native_collectives(), record_p2p(log, copy_sends=True):
            arrived, recv_counts = dispatch(rows.clone(), counts.clone())
        out["results"].append((arrived, recv_counts))
    out["log"] = log
    return out


def _rows_for_others(rank: int) -> int:
    """Rows rank ``rank`` must send other ranks, over all cases: its own experts' stay home."""
    return sum(
        sum(c for e, c in enumerate(CASES[case][rank]) if e // LOCAL != rank)
        for case in range(len(CASES))
    )


def check_dispatch(dispatch: Callable[..., Any]) -> None:
    """Run the learner's ``dispatch`` on 3 ranks; CheckFailed says what is wrong."""
    try:
        results = launch_check(dispatch_on_rank, dispatch, world_size=P, quiet=True, timeout=60)
    except RankFailedError as exc:
        if exc.exc_type == NativeCollectiveUsed.__name__:
            raise CheckFailed(f"rank {exc.rank}: {exc.exc_message}") from None
        raise CheckFailed(
            f"rank {exc.rank} failed ({exc.exc_type}: {exc.exc_message.splitlines()[0][:200]}). "
            "A rank killed inside gloo received more elements than the buffer it posted: "
            "exchange the counts first, and size each receive from them."
        ) from None
    except JobTimeoutError:
        raise CheckFailed(
            "the ranks waited on each other until the 60 s timeout: a receive no rank sends "
            "to (every rank must take part in both exchanges, even with nothing to send), or "
            "two ranks that both block in dist.send/recv. Post each exchange's sends and "
            "receives together in one dist.batch_isend_irecv."
        ) from None
    judge_dispatch(results)
    passed(
        f"your dispatch matches on {P} ranks ({len(CASES)} routings, with zero-row messages "
        "and a rank without tokens), sends each row once, and is NCCL-safe"
    )


def judge_dispatch(results: list[dict[str, Any]]) -> None:
    """Raise CheckFailed naming the first problem in the ranks' :func:`dispatch_on_rank`."""
    for case in range(len(CASES)):
        for rank, res in enumerate(results):
            arrived, recv_counts = res["results"][case]
            want_rows, want_counts = expected_dispatch(case, rank)
            routing = ", ".join(f"rank {q} sends {list(CASES[case][q])}" for q in range(P))
            for problem in (
                compare(want_counts, recv_counts, what=f"recv_counts on rank {rank}"),
                compare(want_rows, arrived, what=f"arrived rows on rank {rank} (labels 1000 "
                        "* source rank + row)"),
            ):  # fmt: skip
                if problem:
                    raise CheckFailed(f"case {case} ({routing} rows per expert): {problem}")
    for rank, res in enumerate(results):
        sends = [c for c in res["log"] if c.kind == "send" and c.data is not None]
        floats = sum(c.numel for c in sends if c.data.is_floating_point())  # rows, not counts
        need = _rows_for_others(rank) * D
        if floats > need:
            raise CheckFailed(
                f"rank {rank} sent {floats} row elements where {need} suffice: every row "
                "must go once, to the rank that holds "
                "its expert, never to all ranks (an all-gather of every token is p - 1 times "
                "the traffic of the all-to-all), and a rank's rows for its own experts stay local"
            )
    problems = nccl_problems([res["log"] for res in results])
    if problems:
        raise CheckFailed(
            "right answer, but this message order can deadlock under NCCL: "
            + problems[0]
            + ". Post each exchange's sends and receives in one dist.batch_isend_irecv."
        )
