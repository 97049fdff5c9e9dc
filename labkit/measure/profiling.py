"""Scaling measured on this machine: the miniature ResNet at 1..N ranks, strong and weak (S2, K9).

One launch of ``max(world_sizes)`` ranks runs every size in turn on a subgroup of the first
``k`` ranks (the others sleep at a barrier), so the process start is paid once.

* strong scaling: global batch fixed, ``global_batch / k`` per rank; efficiency ``t1 / (k tk)``
  in time per step (the same samples per step at every k);
* weak scaling: ``per_rank_batch`` fixed; efficiency ``t1 / tk``.

The learning rate follows the linear scaling rule with warm-up (Goyal et al. 2017): ``lr`` at
``base_batch``, scaled to each run's global batch, reached after ``warmup_steps``.
On a CPU with fewer cores than ranks the ranks share cores, and the efficiency says so.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.data.mnist import MNIST
from labkit.labs.mnist import lr_at, scaled_lr
from labkit.launch import launch, seed_everything
from labkit.models.resnet import resnet_mini

__all__ = ["scaling_worker", "measure_scaling"]


def _train(
    group: Any, ranks: int, batch: int, steps: int, lr: float, warmup: int, data: MNIST
) -> dict[str, float]:
    rank = dist.get_rank(group)
    seed_everything(0)
    model = resnet_mini()
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=0, group=group)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
    times: list[float] = []
    losses: list[float] = []
    for step in range(steps):
        start = (step * ranks + rank) * batch % (len(data) - batch)
        x, y = (
            data.images[start : start + batch],
            data.labels[start : start + batch],
        )  # (b, 1, 28, 28)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, lr, warmup)
        dist.barrier(group=group)
        t = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
        dist.all_reduce(flat, group=group)
        flat /= ranks
        torch.nn.utils.vector_to_parameters(flat, [p.grad for p in params])  # type: ignore[misc]
        opt.step()
        opt.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
    return {"step": statistics.median(times[3:]), "loss": losses[-1], "lr": lr}


def _idle_barrier() -> None:
    """A barrier that sleeps while it waits, so idle ranks leave the cores to the measured ones."""
    work = dist.barrier(async_op=True)
    while not work.is_completed():
        time.sleep(0.005)


def scaling_worker(
    world_sizes: Sequence[int],
    global_batch: int,
    per_rank_batch: int,
    steps: int,
    lr: float,
    base_batch: int,
    warmup: int,
) -> dict[str, dict[int, dict[str, float]]]:
    rank = dist.get_rank()
    data = MNIST("train", limit=4096)
    out: dict[str, dict[int, dict[str, float]]] = {"strong": {}, "weak": {}}
    for k in world_sizes:
        group = dist.new_group(list(range(k)))  # every rank takes part in creating it
        if rank < k:
            for kind, b in (("strong", global_batch // k), ("weak", per_rank_batch)):
                out[kind][k] = _train(
                    group, k, b, steps, scaled_lr(lr, base_batch, b * k), warmup, data
                )
        _idle_barrier()
    return out


def measure_scaling(
    world_sizes: Sequence[int] = (1, 2, 3, 4),
    *,
    global_batch: int = 48,
    per_rank_batch: int = 16,
    steps: int = 14,
    lr: float = 0.05,
    base_batch: int = 16,
    warmup: int = 3,
    **launch_options: Any,
) -> dict[str, Any]:
    """Seconds per step and efficiency of strong and weak scaling; rank 0's timings."""
    if any(global_batch % k for k in world_sizes) or min(world_sizes) < 1 or steps < 4:
        raise ValueError(
            f"global_batch={global_batch} must divide by every world size {tuple(world_sizes)} "
            f"(all >= 1), and steps={steps} >= 4"
        )
    launch_options.setdefault("backend", "gloo")
    res = launch(
        scaling_worker,
        list(world_sizes),
        global_batch,
        per_rank_batch,
        steps,
        lr,
        base_batch,
        warmup,
        world_size=max(world_sizes),
        **launch_options,
    )[0]
    t1s, t1w = res["strong"][1]["step"], res["weak"][1]["step"]
    eff = {
        "strong": {k: t1s / (k * r["step"]) for k, r in res["strong"].items()},
        "weak": {k: t1w / r["step"] for k, r in res["weak"].items()},
    }
    return {"runs": res, "efficiency": eff}
