"""The profiler's per-step counts see labkit's own collectives, not only torch's (issue 21, 10).

Kept apart from ``test_profiling.py``, whose module is marked ``timing`` (run alone, last):
these are counts, not durations, and run with the rest.

A DDP step over ``Comm(impl="ring")`` all-reduces once per bucket, on the communication
thread, through labkit's ring and recursive doubling (point-to-point messages only, so no
``gloo:all_reduce`` ever appears); ``labkit:all_reduce`` ranges make them countable. The same
step over torch's collectives must still count one per bucket: no double count, and a labkit
collective nested in another (the ring's reduce-scatter inside its all-reduce, the chosen
algorithm inside ``auto.all_reduce``) is one all-reduce.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.ranks import run_ranks

STEPS = 3


def _counts() -> dict[str, Any]:
    from labkit.collectives import Comm
    from labkit.collectives.auto import all_reduce
    from labkit.collectives.ring_tuned import tuned_all_reduce
    from labkit.ddp import BucketedDDP, OverlappedDDP
    from labkit.profiling.breakdown import breakdown_from_events, region, step_profiler

    out: dict[str, Any] = {}
    for wrapper in (OverlappedDDP, BucketedDDP):
        for impl in ("torch", "ring"):
            torch.manual_seed(0)
            net = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))
            model = wrapper(net, comm=Comm(None, impl), bucket_cap_mb=0.01)  # 16.6 KB a layer
            with step_profiler() as prof:
                for _ in range(STEPS):
                    with region("step"):
                        with region("forward"):
                            loss = model(torch.randn(8, 64)).square().mean()
                        with region("backward"):
                            loss.backward()
                        with region("comm"):
                            model.finish_gradient_sync()
                    model.zero_grad(set_to_none=True)
            b = breakdown_from_events(prof.events(), rank=0, samples=8)
            out[f"{wrapper.__name__} {impl}"] = (b.counts["all-reduces"], len(model.buckets))
    with step_profiler() as prof, region("step"):  # direct calls: each one all-reduce
        x = torch.ones(100_000)  # 400 KB: recursive doubling under auto; the ring directly
        all_reduce(x)
        tuned_all_reduce(x)
    b = breakdown_from_events(prof.events(), rank=0, samples=1)
    out["direct"] = b.counts["all-reduces"]
    return out


def test_profiled_steps_count_labkit_and_torch_all_reduces_once_per_bucket() -> None:
    for rank_out in run_ranks(_counts, world_size=2, timeout=120):
        for case, value in rank_out.items():
            if case == "direct":
                assert value == 2, rank_out
                continue
            counted, buckets = value
            assert buckets > 1, (case, buckets)  # several buckets: a count of 1 proves nothing
            assert counted == buckets, (case, counted, buckets)
