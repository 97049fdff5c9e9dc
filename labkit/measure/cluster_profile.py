"""A1's per-rank view of notebook 09's DDP step: a few steps under ``torch.profiler``.

Split from ``cluster.py`` (which calls it after the timed steps of :func:`ddp_worker`): each
part of the step runs inside a :func:`labkit.profiling.breakdown.region` (data, forward,
backward, the exposed gradient sync, optimizer), and the breakdown is read back per rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from labkit.models.bert import bert_loss


def _profiled_steps(
    state: tuple[Any, Any], task: Any, per_rank: int, g: torch.Generator, steps: int
) -> dict[str, Any]:
    """``steps`` more steps under ``torch.profiler`` with labkit's regions: this rank's
    :class:`labkit.profiling.breakdown.Breakdown` as a dict."""
    from labkit.profiling.breakdown import breakdown_from_events, region, step_profiler

    model, opt = state
    with step_profiler("cpu") as prof:
        for _ in range(steps):
            with region("step"):
                with region("data"):
                    batch = task.batch(torch.randint(0, len(task), (per_rank,), generator=g))
                with region("forward"):
                    loss = bert_loss(model, *batch)
                with region("backward"):
                    loss.backward()
                with region("comm"):
                    model.finish_gradient_sync()
                with region("optimizer"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
    breakdown = breakdown_from_events(prof.events(), rank=dist.get_rank(), samples=per_rank)
    return breakdown.as_dict()
