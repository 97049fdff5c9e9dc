"""Check for exercise 03 (DDP hooks): the learner's overlapped, bucketed gradient sync.

Contract checked: ``cls(module, bucket_cap_mb=..., record_events=...)`` is a subclass of
:class:`labkit.ddp.BucketedDDP` (or another :class:`labkit.ddp.DataParallel`) whose gradient
hooks launch each bucket's all-reduce during backward (``self.start_allreduce``) and whose
``finish_gradient_sync()`` waits for them and writes the averaged gradients back.

The harness (:mod:`labkit.ddp.equivalence`) trains :class:`~labkit.ddp.equivalence.AwkwardNet`
(frozen weight, tied weight, a layer unused in some steps or on some ranks) on 2 ranks for 4
steps with gradient accumulation 3, and compares every parameter after every step with
single-process training on the full batch. The first difference is reported by step and
parameter name, with a hint about what usually causes it.

Then one recorded step must really overlap, which is about *order*, not speed:

* bucket 0's all-reduce started before backward ended (correct but all sent after backward
  is not done);
* a later gradient hook ran while bucket 0 was still in flight, i.e. between its
  ``start_allreduce`` and its ``wait()``. A hook that starts the all-reduce and waits for it
  at once (a blocking all-reduce inside the hook) starts during backward too, but stalls
  backward for the whole collective: this rule rejects it. The check logs launches, waits
  and gradient hooks in the order they happen, so the verdict does not depend on timing.
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

    wrap = lambda m: cls(m, bucket_cap_mb=TINY_MB)  # noqa: E731
    snaps, _ = eq.train_distributed(wrap, steps=STEPS, accum=ACCUM)
    model = cls(eq.AwkwardNet(), bucket_cap_mb=TINY_MB, record_events=True)
    order: list[tuple[str, str]] = []  # ("start" | "wait", bucket name) and ("grad", parameter)
    start = model.start_allreduce

    class Logged:  # the pending all-reduce, with its wait() written into the order
        def __init__(self, pending: Any, name: str):
            self.pending, self.name = pending, name

        def wait(self) -> None:
            order.append(("wait", self.name))
            self.pending.wait()

    def start_logged(buf: Any, name: str) -> Logged:
        order.append(("start", name))
        return Logged(start(buf, name), name)

    model.start_allreduce = start_logged
    for p in model.params:  # registered after the learner's hooks: runs after them
        p.register_post_accumulate_grad_hook(lambda q: order.append(("grad", model.names[id(q)])))
    x, y, _ = eq.make_batches(1, 1, 12)[0]
    F.cross_entropy(model(x, torch.ones(12, dtype=torch.bool)), y).backward()
    model.finish_gradient_sync()
    events = [(e.kind, e.start, e.end) for e in model.events]
    return {"snaps": snaps, "events": events, "buckets": len(model.buckets), "order": order}


def _grads_in_flight(order: list[tuple[str, str]]) -> tuple[str, int] | None:
    """The first bucket started and how many gradient hooks ran between its start and wait."""
    starts = [i for i, (kind, _) in enumerate(order) if kind == "start"]
    if not starts:
        return None
    first, name = starts[0], order[starts[0]][1]
    end = next((i for i in range(first, len(order)) if order[i] == ("wait", name)), len(order))
    return name, sum(kind == "grad" for kind, _ in order[first:end])


def check_overlapped_ddp(cls: type) -> None:
    """Train with ``cls`` on 2 ranks; raise :class:`CheckFailed` naming the first divergence."""
    from labkit.ddp import DataParallel
    from labkit.ddp import equivalence as eq

    if not (isinstance(cls, type) and issubclass(cls, DataParallel)):
        raise CheckFailed(
            f"pass the class itself, a subclass of labkit.ddp.BucketedDDP; got {cls!r}"
        )
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
    if not backward or not comm or not comm[0][1] < backward[0][2]:
        raise CheckFailed(
            "the results are right but nothing overlaps: the first all-reduce started after "
            "backward ended. Launch a bucket from the gradient hook as soon as its last "
            "gradient is ready."
        )
    started = sum(kind == "start" for kind, _ in results[0]["order"])
    if started != results[0]["buckets"] or len(comm) != started:
        raise CheckFailed(
            f"one step with {results[0]['buckets']} buckets started {started} all-reduces through "
            f"self.start_allreduce() and recorded {len(comm)}; launch each bucket exactly once, "
            "with it"
        )
    name, in_flight = _grads_in_flight(results[0]["order"]) or ("bucket 0", 0)
    if in_flight == 0:
        raise CheckFailed(
            f"the results are right but backward stalls: {name}'s all-reduce was waited for "
            "before any later gradient was ready, so the hook blocks backward for the whole "
            "collective. Start the all-reduce in the hook and wait() for it only in "
            "finish_gradient_sync."
        )
    passed(
        f"{STEPS} steps (accumulation {ACCUM}) on {WORLD_SIZE} ranks match single-process training "
        f"for every parameter; bucket 0's all-reduce started during backward and was still in "
        f"flight while {in_flight} later gradients were computed"
    )
