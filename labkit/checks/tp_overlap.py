"""Check for exercise 18 (chunked all-gather-matmul): the decomposed SP all-gather, on ranks.

The learner writes ``chunked_all_gather_matmul(shard, weight, ring) -> out``: ``shard`` is this
rank's (n, B, d) sequence chunk (sequence first), ``weight`` (o, d), ``ring`` a
:class:`~labkit.tensor_parallel.overlap_ring.RingSteps` (``ring.rank``, ``ring.size``;
``ring.start(step, sends, recvs)`` posts one step's messages to rank + 1 and from rank - 1 as
one batch, ``ring.wait(step)`` completes them). ``out`` is (t n, B, o): ``F.linear`` of every
rank's chunk, in rank order, each chunk multiplied while the next one travels.

Run on 2 and 4 gloo ranks, it is judged on three things, each rejecting one wrong approach:

* the values: chunk k of ``out`` must be rank k's rows times the weight. A chunk order that
  sends the wrong way round the ring (or receives into the wrong place) puts another rank's
  rows there: named, rank and chunk;
* the messages, replayed under NCCL's rules (:func:`labkit.collectives.nccl_order.
  nccl_problems`): an ungrouped ``irecv`` then ``isend`` between the same two ranks passes on
  gloo and hangs on GPUs;
* the overlap: at least one matmul must run between a step's ``start`` and its ``wait``
  (counted by a dispatch mode). Waiting first is correct and hides nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.checks.core import CheckFailed, launch_check, passed
from labkit.collectives.nccl_order import record_p2p
from labkit.tensor_parallel.overlap_ring import RingSteps

__all__ = ["check_chunked_all_gather_matmul", "judge", "run_on_rank"]

AGMatmul = Callable[[torch.Tensor, torch.Tensor, RingSteps], torch.Tensor]
N, B, D, OUT = 2, 3, 4, 5  # rows per chunk, batch, features in, features out
MATMULS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.matmul.default")


def _shard(rank: int) -> torch.Tensor:
    """(N, B, D): rank r's rows, values r*100 + position, so a misplaced chunk names its rank."""
    return (100.0 * rank + torch.arange(N * B * D, dtype=torch.float32)).reshape(N, B, D)


def _weight() -> torch.Tensor:
    return torch.randn(OUT, D, generator=torch.Generator().manual_seed(18))


class _Events(TorchDispatchMode):
    def __init__(self, events: list[tuple[str, int]]) -> None:
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if str(func) in MATMULS:
            self.events.append(("matmul", -1))
        return func(*args, **(kwargs or {}))


class _Watched(RingSteps):
    """A RingSteps that notes when each step was posted and waited for."""

    def __init__(self, events: list[tuple[str, int]]) -> None:
        super().__init__(None)
        self.events = events

    def start(self, step: int, sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> None:
        self.events.append(("start", step))
        super().start(step, sends, recvs)

    def wait(self, step: int) -> None:
        super().wait(step)
        self.events.append(("wait", step))


def run_on_rank(fn: AGMatmul) -> dict[str, Any]:
    """On one rank: the learner's output, its point-to-point log and its event order."""
    events: list[tuple[str, int]] = []
    log: list[Any] = []
    ring = _Watched(events)
    with record_p2p(log), _Events(events):
        out = fn(_shard(dist.get_rank()), _weight(), ring)
    return {"out": out, "log": log, "events": events}


def judge(results: list[dict[str, Any]]) -> None:
    """Raise :class:`CheckFailed` for the first wrong value, NCCL problem or missing overlap."""
    from labkit.collectives.nccl_order import nccl_problems

    t = len(results)
    want = torch.cat([F.linear(_shard(k), _weight()) for k in range(t)])  # (t N, B, OUT)
    for rank, res in enumerate(results):
        out = res["out"]
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(want.shape):
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise CheckFailed(f"t={t}, rank {rank}: expected a (t n, B, o) = {tuple(want.shape)} "
                              f"tensor, got {shape}")  # fmt: skip
        for k in range(t):
            got, exp = out[k * N : (k + 1) * N], want[k * N : (k + 1) * N]
            if torch.allclose(got, exp, rtol=1e-5, atol=1e-4):
                continue
            came = [
                j for j in range(t) if torch.allclose(got, want[j * N : (j + 1) * N], 1e-5, 1e-4)
            ]
            whose = f"rank {came[0]}'s rows" if came else "no rank's rows"
            raise CheckFailed(
                f"t={t}, rank {rank}: chunk {k} of the output holds {whose} times the weight; "
                f"it must hold rank {k}'s. At step s a rank multiplies and sends chunk r - s and "
                f"receives chunk r - s - 1 from rank r - 1 (the one that rank just multiplied)"
            )
    problems = nccl_problems([res["log"] for res in results])
    if problems:
        raise CheckFailed(f"t={t}: correct on gloo, but under NCCL: {problems[0]}. Post each "
                          f"step's send and receive together with ring.start")  # fmt: skip
    for rank, res in enumerate(results):
        ev = res["events"]
        for step in range(t - 1):
            if ("start", step) not in ev or ("wait", step) not in ev:
                raise CheckFailed(f"t={t}, rank {rank}: step {step} was never posted and waited "
                                  f"for with ring.start / ring.wait")  # fmt: skip
            between = ev[ev.index(("start", step)) : ev.index(("wait", step))]
            if not any(e[0] == "matmul" for e in between):
                raise CheckFailed(
                    f"t={t}, rank {rank}: no matmul ran while step {step}'s transfer was in "
                    f"flight: the values are right, but waiting before multiplying hides "
                    f"nothing. Post the next chunk's transfer, multiply the chunk you hold, "
                    f"then wait"
                )


def check_chunked_all_gather_matmul(fn: AGMatmul) -> None:
    """Run ``fn`` on 2 and 4 gloo ranks and judge it (module docstring); print PASSED."""
    for t in (2, 4):
        judge(launch_check(run_on_rank, fn, world_size=t, timeout=120))
    passed("equal to gathering then multiplying on 2 and 4 ranks, NCCL-safe, and every "
           "transfer travels under a matmul")  # fmt: skip
