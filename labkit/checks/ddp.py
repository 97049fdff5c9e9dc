"""Check for exercise 03 (DDP hooks): the learner's overlapped, bucketed gradient sync.

Contract checked: ``cls(module, bucket_cap_mb=..., record_events=...)`` is a subclass of
:class:`labkit.ddp.BucketedDDP` whose gradient hooks launch each bucket's all-reduce during
backward (``self.start_allreduce``) and whose ``finish_gradient_sync()`` waits for them and
writes the averaged gradients back.

The harness (:mod:`labkit.ddp.equivalence`) trains :class:`~labkit.ddp.equivalence.AwkwardNet`
(frozen weight, tied weight, a layer unused in some steps or on some ranks) on 2 ranks for 4
steps with gradient accumulation 3, and compares every parameter after every step with
single-process training on the full batch. The first difference is reported by step and
parameter name, with a hint about what usually causes it. Then one recorded step must show an
all-reduce that started before backward ended: correct but not overlapped is not done.
"""

from __future__ import annotations

from typing import Any

from labkit.checks.core import CheckFailed, launch_check, passed
from labkit.launch import JobTimeoutError

__all__ = ["check_overlapped_ddp"]

WORLD_SIZE, STEPS, ACCUM, TINY_MB = 2, 4, 3, 0.0005

_HINTS = {
    "extra.": "a parameter nobody used this step must keep grad=None (the used flags in the "
    "buffer after the all-reduce say so) and a bucket with such a parameter must still be "
    "launched before the step (in finish_gradient_sync)",
    "tied.": "a tied weight fires its hook once per backward; make sure it is counted once",
    "": "are the gradients averaged (unpack divides by world_size) and written back after wait()?",
}


def _run_learner(cls: Any) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from labkit.ddp import equivalence as eq

    snaps, _ = eq.train_distributed(lambda m: cls(m, bucket_cap_mb=TINY_MB), steps=STEPS, accum=ACCUM)
    model = cls(eq.AwkwardNet(), bucket_cap_mb=TINY_MB, record_events=True)
    x, y, _ = eq.make_batches(1, 1, 12)[0]
    F.cross_entropy(model(x, torch.ones(12, dtype=torch.bool)), y).backward()
    model.finish_gradient_sync()
    events = [(e.kind, e.start, e.end) for e in model.events]
    return {"snaps": snaps, "events": events, "buckets": len(model.buckets)}


def check_overlapped_ddp(cls: type) -> None:
    """Train with ``cls`` on 2 ranks; raise :class:`CheckFailed` naming the first divergence."""
    from labkit.ddp import BucketedDDP
    from labkit.ddp import equivalence as eq

    if not (isinstance(cls, type) and issubclass(cls, BucketedDDP)):
        raise CheckFailed(f"pass the class itself, a subclass of labkit.ddp.BucketedDDP; got {cls!r}")
    try:
        results = launch_check(_run_learner, cls, world_size=WORLD_SIZE, timeout=60, quiet=True)
    except JobTimeoutError:
        raise CheckFailed(
            "the ranks hung: one rank waited in an all-reduce the other never started. Every rank "
            "must launch the same buckets in the same order, including buckets holding a parameter "
            "that got no gradient on this rank (launch those in finish_gradient_sync)."
        ) from None
    reference = eq.train_reference(STEPS, ACCUM)
    for rank, got in enumerate(results):
        problem = eq.first_divergence(reference, got["snaps"])
        if problem:
            hint = next(h for prefix, h in _HINTS.items() if prefix in problem)
            raise CheckFailed(f"rank {rank}: {problem}.\nHint: {hint}.")
    events = results[0]["events"]
    comm = [e for e in events if e[0] == "allreduce"]
    backward = [e for e in events if e[0] == "backward"]
    if len(comm) != results[0]["buckets"]:
        raise CheckFailed(
            f"one step with {results[0]['buckets']} buckets recorded {len(comm)} all-reduces started "
            "through self.start_allreduce(); launch each bucket exactly once, with it"
        )
    if not backward or not comm[0][1] < backward[0][2]:
        raise CheckFailed(
            "the results are right but nothing overlaps: the first all-reduce started after backward "
            "ended. Launch a bucket from the gradient hook as soon as its last gradient is ready."
        )
    passed(
        f"{STEPS} steps (accumulation {ACCUM}) on {WORLD_SIZE} ranks match single-process training "
        f"for every parameter, and bucket 0's all-reduce started during backward"
    )
