"""Diagnosis drills: a small data-parallel MNIST run with one injected fault, profiled per rank.

The learner gets a run whose fault is hidden, reads its step breakdown
(:mod:`labkit.profiling.breakdown`) against a clean run, names the fault, then applies the fix
and measures before against after. Every fault is one a real job meets; the table of
faults (what is injected, where it shows up, the fix) is data, ``drills_faults.json``, read by
:mod:`labkit.labs.drills_faults` (``FAULTS``, ``CUDA_ONLY``, ``SIGNATURE``). The elastic
distortion of ``starved_loader`` is :mod:`labkit.labs.drills_distort`; the number that names
each fault, :func:`labkit.labs.drills_evidence.evidence`. A fault's ``note`` in the data says what
its device changes (``host_sync`` costs microseconds on a CPU, a stall on CUDA).

Gradients are averaged by a flat buffer all-reduced in chunks of ``bucket_kb`` after backward
(no overlap), so all communication is exposed and lands in ``comm``.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from labkit.checkpoint.sharded import save_checkpoint
from labkit.data.mnist import MNIST
from labkit.data.sampler import shard_indices
from labkit.labs.drills_distort import Distorted
from labkit.labs.drills_evidence import Mystery, _ms, evidence
from labkit.labs.drills_faults import CUDA_ONLY, FAULTS, SIGNATURE
from labkit.launch import launch, local_device, seed_everything
from labkit.models.mlp import MLP
from labkit.profiling.breakdown import (
    Breakdown,
    breakdown_from_events,
    export_trace,
    region,
    step_profiler,
)

__all__ = [
    "FAULTS",
    "CUDA_ONLY",
    "SIGNATURE",
    "DrillConfig",
    "available_faults",
    "train",
    "run_drills",
    "evidence",
    "Mystery",
    "mystery_run",
    "before_after",
    "Distorted",
]

UNEVEN_FACTOR = 6


def available_faults(device: torch.device | str = "cpu") -> tuple[str, ...]:
    """The faults that can be injected on ``device`` (``unpinned_copy`` needs CUDA)."""
    cuda = torch.device(device).type == "cuda"
    return tuple(f for f in FAULTS if cuda or f not in CUDA_ONLY)


@dataclass(frozen=True)
class DrillConfig:
    """One profiled run. ``fault=None`` is the clean run; ``fixed=True`` applies the fault's fix."""

    fault: str | None = None
    fixed: bool = False
    steps: int = 5  # profiled steps
    warmup: int = 1  # unprofiled steps first (allocations, first-call costs)
    batch_size: int = 64  # per rank
    sizes: tuple[int, ...] = (784, 1024, 512, 10)  # the MLP: 1.33M parameters, 5.3 MB of gradients
    bucket_kb: float = 32 * 1024.0  # clean: the whole gradient in one all-reduce
    tiny_bucket_kb: float = 16.0
    straggle_s: float = 0.25  # extra seconds per step on the straggling rank
    transform_kernel: int = 11  # the elastic transform's smoothing kernel (its cost)
    workers_when_fixed: int = 2
    lr: float = 0.05
    seed: int = 0
    trace_dir: str | None = None  # write rank r's Chrome trace to trace_dir/rank{r}.json

    def __post_init__(self) -> None:
        if self.fault is not None and self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}; expected one of {FAULTS}")
        if self.steps < 1 or self.warmup < 0 or self.batch_size < 1:
            raise ValueError(f"need steps >= 1, warmup >= 0, batch_size >= 1; got {self}")
        if not (self.bucket_kb > 0 and self.tiny_bucket_kb > 0):
            raise ValueError(
                f"bucket sizes must be > 0 KB, got {self.bucket_kb}, {self.tiny_bucket_kb}"
            )

    def active(self, fault: str) -> bool:
        """Is ``fault`` injected and not fixed in this run?"""
        return self.fault == fault and not self.fixed


def _loader(cfg: DrillConfig, data: Dataset, rank: int, world_size: int, cuda: bool) -> DataLoader:
    per_rank = cfg.batch_size * (
        UNEVEN_FACTOR if cfg.active("uneven_batches") and rank == world_size - 1 else 1
    )
    n_batches = cfg.warmup + cfg.steps
    idx = shard_indices(len(data), rank, world_size, seed=cfg.seed)  # type: ignore[arg-type]
    idx = (idx * (1 + per_rank * n_batches // max(len(idx), 1)))[: per_rank * n_batches]
    if cfg.fault == "starved_loader":
        data = Distorted(data, cfg.transform_kernel, seed=cfg.seed)
    workers = cfg.workers_when_fixed if cfg.fault == "starved_loader" and cfg.fixed else 0
    pin = cuda and not cfg.active("unpinned_copy")
    return DataLoader(
        torch.utils.data.Subset(data, idx), batch_size=per_rank, num_workers=workers, pin_memory=pin
    )


def _sync_gradients(params: Sequence[torch.nn.Parameter], bucket_bytes: int, group: Any) -> None:
    """Average gradients over ``group``: one flat buffer, all-reduced in ``bucket_bytes`` pieces."""
    flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]  # (numel,)
    per_piece = max(1, bucket_bytes // flat.element_size())
    for piece in flat.split(per_piece):  # 1-D slices: contiguous views, reduced in place
        dist.all_reduce(piece, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p))  # type: ignore[union-attr]
        offset += n


def train(cfg: DrillConfig, workdir: str, group: Any = None) -> dict[str, Any]:
    """One profiled run on this rank; returns its :class:`Breakdown` as a dict (and the loss)."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    device = local_device()
    cuda = device.type == "cuda"
    if cfg.fault in CUDA_ONLY and not cuda:
        raise ValueError(f"fault {cfg.fault!r} needs CUDA; this rank runs on {device}")
    seed_everything(cfg.seed)
    model = MLP(cfg.sizes).to(device)
    for p in model.parameters():  # identical start on every rank
        dist.broadcast(
            p.data, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group
        )
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    params = list(model.parameters())
    loader = _loader(cfg, MNIST("train", limit=2048), rank, world_size, cuda)
    kb = cfg.tiny_bucket_kb if cfg.active("tiny_buckets") else cfg.bucket_kb
    sync = torch.cuda.synchronize if cuda else None
    slow = cfg.active("straggler") and rank == world_size - 1
    logged: list[float] = []

    def step(batches: Any, k: int) -> None:
        with region("step"):
            with region("data"):
                x, y = next(batches)
            with region("h2d", sync):
                non_blocking = cuda and not cfg.active("unpinned_copy")
                x, y = (
                    x.to(device, non_blocking=non_blocking),
                    y.to(device, non_blocking=non_blocking),
                )
            with region("forward", sync):
                loss = F.cross_entropy(model(x), y)
                if slow:  # a slower device: half its delay in forward, half in backward
                    time.sleep(cfg.straggle_s / 2)
                if cfg.active("host_sync"):
                    logged.append(loss.item())
            with region("backward", sync):
                loss.backward()
                if slow:
                    time.sleep(cfg.straggle_s / 2)
            with region("comm", sync):
                _sync_gradients(params, int(kb * 1024), group)
            with region("optimizer", sync):
                opt.step()
                opt.zero_grad(set_to_none=True)
            if cfg.active("checkpoint_every_step"):
                state = {"model": model.state_dict(), "optim": opt.state_dict()}
                save_checkpoint(Path(workdir) / "ckpt", k, state, keep=1, group=group)

    batches = iter(loader)
    for k in range(cfg.warmup):
        step(batches, k)
    dist.barrier(group=group)  # profile the same steps on every rank
    with step_profiler(device) as prof:
        for k in range(cfg.warmup, cfg.warmup + cfg.steps):
            step(batches, k)
    samples = loader.batch_size or 0
    b = breakdown_from_events(prof.events(), rank=rank, samples=samples)
    out: dict[str, Any] = {"breakdown": b.as_dict(), "fault": cfg.fault, "fixed": cfg.fixed}
    if cfg.trace_dir is not None:
        out["trace"] = str(export_trace(prof, Path(cfg.trace_dir) / f"rank{rank}.json"))
    return out


def _train_each(cfgs: list[DrillConfig], workdir: str) -> list[dict[str, Any]]:
    # A throwaway clean run first: the profiler's and gloo's first-use costs land there.
    train(replace(cfgs[0], fault=None, steps=1, trace_dir=None), os.path.join(workdir, "warm"))
    return [train(cfg, os.path.join(workdir, str(i))) for i, cfg in enumerate(cfgs)]


def run_drills(
    cfgs: Sequence[DrillConfig], world_size: int = 2, *, runner: Any = None, **launch_options: Any
) -> list[list[Breakdown]]:
    """Run every config in ONE launch (one process start for all); per config, one
    :class:`Breakdown` per rank. ``runner`` replaces ``labkit.launch`` (tests pass theirs)."""
    cfgs = list(cfgs)
    if world_size < 2:
        raise ValueError(f"drills need world_size >= 2 (faults between ranks), got {world_size}")
    bad = [
        c.fault for c in cfgs if c.fault in CUDA_ONLY and launch_options.get("backend") == "gloo"
    ]
    if bad:
        raise ValueError(f"faults {bad} need CUDA (NCCL); skip them on a CPU")
    with tempfile.TemporaryDirectory(prefix="labkit-drills-") as workdir:
        run = runner or launch
        per_rank = run(_train_each, cfgs, workdir, world_size=world_size, **launch_options)
    return [
        [Breakdown.from_dict(per_rank[r][i]["breakdown"]) for r in range(world_size)]
        for i in range(len(cfgs))
    ]


def with_fault(cfg: DrillConfig, fault: str | None, fixed: bool = False) -> DrillConfig:
    return replace(cfg, fault=fault, fixed=fixed)


def mystery_run(
    seed: int | None = None,
    world_size: int = 2,
    device: str = "cpu",
    trace_dir: str | None = None,
    **launch_options: Any,
) -> Mystery:
    """Pick a fault at random (``seed`` for a repeatable pick); run clean, faulty and fixed in
    one launch. ``trace_dir``: the clean run's per-rank Chrome traces go there."""
    import random

    fault = random.Random(seed).choice(available_faults(device))
    cfg = DrillConfig(fault=fault)
    runs = [DrillConfig(trace_dir=trace_dir), cfg, replace(cfg, fixed=True)]
    clean, faulty, fixed = run_drills(runs, world_size, **launch_options)
    return Mystery(faulty, clean, fault, cfg, fixed)


def before_after(
    fault: str, world_size: int = 2, **launch_options: Any
) -> tuple[list[Breakdown], list[Breakdown]]:
    """The run with ``fault`` and the same run with its fix, measured in one launch."""
    before, after = run_drills(
        [DrillConfig(fault=fault), DrillConfig(fault=fault, fixed=True)],
        world_size,
        **launch_options,
    )
    return before, after


def main(argv: list[str] | None = None) -> None:
    """``python -m labkit.labs.drills``: every fault available here, before and after its fix."""
    import argparse

    from labkit.profiling.breakdown import format_table

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--faults", nargs="*", default=None, help=f"subset of {FAULTS}")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    faults = args.faults or list(available_faults(device))
    cfgs = [DrillConfig()] + [DrillConfig(fault=f, fixed=x) for f in faults for x in (False, True)]
    t0 = time.perf_counter()
    runs = run_drills(cfgs, args.world_size, timeout=600)
    print(format_table(runs[0], "clean"))
    for k, fault in enumerate(faults):
        before, after = runs[1 + 2 * k], runs[2 + 2 * k]
        print(f"\n=== {fault}: {evidence(fault, before, runs[0])}; fix: {SIGNATURE[fault][1]}")
        print(format_table(before, "before"))
        print(format_table(after, "after"))
        print(
            f"step: {_ms(max(b.step_seconds for b in before))} -> "
            f"{_ms(max(b.step_seconds for b in after))}"
        )
    print(f"\nwall time {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    # Run from the imported module, not __main__: ranks and loader workers unpickle the
    # configs and datasets by their module path.
    from labkit.labs.drills import main as _main

    _main()
