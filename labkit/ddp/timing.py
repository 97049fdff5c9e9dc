"""Measuring the variants: step time on a rank, bucket-size sweeps, and the overlap timeline.

The timeline's picture is :func:`labkit.viz.ddp.plot_timeline`.

Used by notebook 03 and ``benchmarks/bench_ddp.py``. A "step" is what training pays per
optimizer step: forward, backward, gradient sync, ``optimizer.step()``. Every timed step
starts after a barrier, so a rank that finished early does not hide the other's lag, and
the median over steps resists the noise of a shared machine.

Two workloads bracket data parallelism:

* **compute-bound**: :class:`~labkit.models.MnistCNN` (421,642 params, 1.6 MiB of fp32
  gradients; see its docstring), where the convolutions dominate the step;
* **communication-bound**: a wide :class:`~labkit.models.MLP` (784-2048-2048-10: 5,824,522
  params, 22 MiB), few FLOPs per byte of gradient, so the all-reduce is most of the step
  unless it is hidden.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from labkit.ddp.base import Event
from labkit.launch import local_device
from labkit.models import MLP, MnistCNN

Wrap = Callable[[nn.Module], nn.Module]

WORKLOADS: dict[str, tuple[Callable[[], nn.Module], int]] = {
    # name: (model factory, per-rank batch)
    "cnn": (lambda: MnistCNN(channels=32), 32),
    "mlp": (lambda: MLP((784, 2048, 2048, 10)), 8),
}


def _batch(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(dist.get_rank() if dist.is_initialized() else 0)
    x = torch.randn(n, 1, 28, 28, generator=g)  # (n, 1, 28, 28): both workloads take MNIST shapes
    return x.to(device), torch.randint(0, 10, (n,), generator=g).to(device)


class Trainer:
    """One model under one wrapper, ready to take timed steps on a fixed batch; ``phases`` holds
    the last step's parts in seconds (forward, backward, finish: the wrapper's
    ``finish_gradient_sync``, optimizer: step and zero_grad)."""

    def __init__(self, wrap: Wrap, workload: str):
        make, batch = WORKLOADS[workload]
        device = local_device()
        torch.manual_seed(0)
        self.device = device
        self.model = wrap(make().to(device))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.x, self.y = _batch(batch, device)
        self.finish = getattr(self.model, "finish_gradient_sync", lambda: None)
        self.phases: dict[str, float] = {}

    def step(self) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        loss = F.cross_entropy(self.model(self.x), self.y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.finish()
        t3 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t4 = time.perf_counter()
        self.phases = {"forward": t1 - t0, "backward": t2 - t1, "finish": t3 - t2,
                       "optimizer": t4 - t3}  # fmt: skip
        return t4 - t0


def step_time(wrap: Wrap, workload: str = "mlp", steps: int = 10, warmup: int = 3) -> float:
    """Median seconds per training step of ``wrap(model)`` on this rank (call on every rank)."""
    trainer = Trainer(wrap, workload)
    times = [trainer.step() for _ in range(warmup + steps)]
    return statistics.median(times[warmup:])


def step_time_samples(
    wraps: dict[str, Wrap],
    workloads: tuple[str, ...] = ("cnn", "mlp"),
    steps: int = 10,
    warmup: int = 3,
) -> dict[tuple[str, str], list[float]]:
    """Run on every rank: ``{(workload, name): seconds of each timed step}``, each step the
    slowest rank's.

    The variants take turns step by step (A, B, C, A, B, C, ...), so a burst of load on a
    shared machine hits all of them alike: step ``i`` of two variants is a fair pair, and the
    ratio of a pair is steadier than the ratio of two medians.
    """
    out = {}
    for workload in workloads:
        trainers = {name: Trainer(wrap, workload) for name, wrap in wraps.items()}
        samples: dict[str, list[float]] = {name: [] for name in wraps}
        for i in range(warmup + steps):
            for name, trainer in trainers.items():
                t = trainer.step()
                if i >= warmup:
                    samples[name].append(t)
        for name, values in samples.items():
            slowest = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # same length on every rank
            out[(workload, name)] = slowest.tolist()
        del trainers
    return out


def compare_step_times(
    wraps: dict[str, Wrap],
    workloads: tuple[str, ...] = ("cnn", "mlp"),
    steps: int = 10,
    warmup: int = 3,
) -> dict[tuple[str, str], float]:
    """Run on every rank: ``{(workload, name): median seconds per step}`` of
    :func:`step_time_samples` (each step the slowest rank's)."""
    samples = step_time_samples(wraps, workloads, steps, warmup)
    return {key: statistics.median(values) for key, values in samples.items()}


def recorded_step(wrap: Wrap, workload: str = "mlp", warmup: int = 2) -> list[Event]:
    """Run on every rank: the timeline (:class:`Event` list) of one step, after ``warmup`` steps."""
    make, batch = WORKLOADS[workload]
    device = local_device()
    model = wrap(make().to(device))
    cast(Any, model).record_events = True  # our wrappers only: torch DDP keeps no timeline
    x, y = _batch(batch, device)
    for _ in range(warmup + 1):
        dist.barrier()
        F.cross_entropy(model(x), y).backward()
        model.finish_gradient_sync()  # type: ignore[operator]
        model.zero_grad(set_to_none=True)
    return list(model.events)  # type: ignore[arg-type]


def overlap_fraction(events: list[Event]) -> float:
    """Share of all-reduce time that ran while backward was still computing (0 = none hidden)."""
    (bwd,) = [e for e in events if e.kind == "backward"]
    comm = [e for e in events if e.kind == "allreduce"]
    total = sum(e.end - e.start for e in comm)
    hidden = sum(max(0.0, min(e.end, bwd.end) - e.start) for e in comm)
    return hidden / total if total > 0 else 0.0
