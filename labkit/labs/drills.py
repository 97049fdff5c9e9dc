"""Diagnosis drills: a small data-parallel MNIST run with one injected fault, profiled per rank.

Why this module is long: the whole drill stays in one place (the faults, the run that
injects one, the evidence each fault leaves, the command line), so the mystery reads in one go;
the fault definitions are most of it.

The learner gets a run whose fault is hidden, reads its step breakdown
(:mod:`labkit.profiling.breakdown`) against a clean run, names the fault, then applies the fix
and measures before against after. Every fault is one a real job meets:

=====================  =====================================================  ==============
fault                  what is injected                                        shows up in
=====================  =====================================================  ==============
starved_loader         an expensive per-sample transform (elastic distortion,  data
                       Simard et al. 2003) in ``__getitem__``, num_workers=0
host_sync              ``loss.item()`` every step (logging)                    host syncs/step
tiny_buckets           gradients all-reduced in 16 KB messages: hundreds of     comm, all-reduces
                       latency-bound collectives instead of one
straggler              the last rank is slower (a throttled or shared GPU):    comm on the others
                       it sleeps inside its forward and backward
uneven_batches         the last rank gets 6x the samples (a bad shard)         comm, samples
unpinned_copy (CUDA)   pageable host memory and a blocking ``.to(device)``     h2d
checkpoint_every_step  a full sharded checkpoint saved after every step        other
=====================  =====================================================  ==============

``host_sync`` costs microseconds on a CPU: every operator already ran to completion when
``.item()`` asks for the value, so there is no queue to drain. On CUDA the host must wait for
every queued kernel, so the CPU can no longer run ahead to launch the next ones; the stall is
as long as the GPU's backlog. The count of ``aten::_local_scalar_dense`` per step is the
evidence on either device.

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
]

FAULTS = (
    "starved_loader",
    "host_sync",
    "tiny_buckets",
    "straggler",
    "uneven_batches",
    "unpinned_copy",
    "checkpoint_every_step",
)
CUDA_ONLY = frozenset({"unpinned_copy"})
# fault -> (the breakdown category that grows the most, or the count that tells, and the fix)
SIGNATURE: dict[str, tuple[str, str]] = {
    "starved_loader": (
        "data",
        "move the transform off the critical path: loader workers (or a batched transform)",
    ),
    "host_sync": ("host syncs", "log a detached running sum; call .item() every N steps"),
    "tiny_buckets": ("comm", "fuse gradients into large buckets (torch DDP: 25 MB)"),
    "straggler": (
        "comm",
        "find the slow rank (its compute per sample) and replace or rebalance it",
    ),
    "uneven_batches": ("comm", "shard the data evenly (DistributedSampler)"),
    "unpinned_copy": ("h2d", "pin_memory=True and .to(device, non_blocking=True)"),
    "checkpoint_every_step": ("other", "checkpoint at the Young/Daly interval, asynchronously"),
}
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


def _gaussian_kernel(size: int, sigma: float) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float32) - size // 2
    k = torch.exp(-(x**2) / (2 * sigma**2))
    k = k / k.sum()
    return (k[:, None] * k[None, :])[None, None]  # (1, 1, size, size)


class Distorted(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Digits with an elastic distortion per sample: a random displacement field smoothed by a
    Gaussian, then resampled (Simard et al. 2003). Deliberately per-sample and unbatched."""

    def __init__(self, base: Dataset, kernel: int, alpha: float = 0.3, seed: int = 0):
        self.base, self.alpha, self.seed = base, alpha, seed
        self.kernel = _gaussian_kernel(kernel, sigma=kernel / 3)
        ys, xs = torch.meshgrid(torch.linspace(-1, 1, 28), torch.linspace(-1, 1, 28), indexing="ij")
        self.grid = torch.stack([xs, ys], -1)[None]  # (1, 28, 28, 2), x then y as grid_sample wants

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        img, label = self.base[i]  # (1, 28, 28)
        g = torch.Generator().manual_seed(self.seed * 100_003 + i)
        field = torch.rand(2, 1, 28, 28, generator=g) * 2 - 1  # (2 displacement maps, 1, 28, 28)
        pad = self.kernel.shape[-1] // 2
        field = F.conv2d(field, self.kernel, padding=pad).view(1, 2, 28, 28) * self.alpha
        grid = self.grid + field.permute(0, 2, 3, 1)  # (1, 28, 28, 2)
        return F.grid_sample(img[None], grid, align_corners=False)[0], label


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


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f} ms"


def evidence(fault: str, faulty: Sequence[Breakdown], clean: Sequence[Breakdown]) -> str:
    """The number in the breakdown that names ``fault``, read from the two runs."""
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; expected one of {FAULTS}")

    def worst(c: str, bs: Sequence[Breakdown]) -> Breakdown:
        return max(bs, key=lambda b: b.seconds[c])

    compute = [b.seconds["forward"] + b.seconds["backward"] for b in faulty]
    slow = max(range(len(faulty)), key=lambda r: compute[r] / max(faulty[r].samples, 1))
    if fault in ("starved_loader", "unpinned_copy", "checkpoint_every_step"):
        c = SIGNATURE[fault][0]
        b = worst(c, faulty)
        base = _ms(worst(c, clean).seconds[c])
        return f"'{c}' was {_ms(b.seconds[c])} per step on rank {b.rank} against {base} clean"
    if fault == "host_sync":
        n, n0 = faulty[0].counts["host syncs"], clean[0].counts["host syncs"]
        return f"'host syncs' per step was {n:g} against {n0:g} clean (aten::_local_scalar_dense)"
    if fault == "tiny_buckets":
        b = worst("comm", faulty)
        return (
            f"'all-reduces' per step was {b.counts['all-reduces']:g} against "
            f"{clean[0].counts['all-reduces']:g} clean, and 'comm' {_ms(b.seconds['comm'])} "
            f"against {_ms(worst('comm', clean).seconds['comm'])}"
        )
    if fault == "uneven_batches":  # the rank with the most work, not the slowest per sample
        slow = max(range(len(faulty)), key=lambda r: compute[r])
    others = [b for b in faulty if b.rank != faulty[slow].rank]
    wait = max(b.seconds["comm"] for b in others)
    if fault == "straggler":
        return (
            f"every rank had {faulty[0].samples} samples, yet rank {slow}'s forward+backward "
            f"took {_ms(compute[slow])} against {_ms(min(compute))}, while the others waited "
            f"in 'comm' {_ms(wait)}"
        )
    return (  # uneven_batches
        f"'samples' per rank were {[b.samples for b in faulty]}: rank {slow} computed "
        f"{_ms(compute[slow])} while the others waited in 'comm' {_ms(wait)}"
    )


class Mystery:
    """A run with one hidden fault, the clean run to compare it with, and the fixed run.

    ``breakdowns``, ``clean`` and (after a diagnosis) ``after``: one :class:`Breakdown` per
    rank. :func:`labkit.checks.drills.check_diagnosis` compares a guess with the hidden fault.
    """

    def __init__(
        self,
        faulty: list[Breakdown],
        clean: list[Breakdown],
        fault: str,
        cfg: DrillConfig,
        fixed: list[Breakdown] | None = None,
    ):
        self.breakdowns, self.clean, self.cfg = faulty, clean, cfg
        self._fault, self._fixed = fault, fixed

    def __repr__(self) -> str:
        return f"Mystery(world_size={len(self.breakdowns)}, fault=<hidden>)"

    def reveal(self) -> str:
        return self._fault

    @property
    def after(self) -> list[Breakdown] | None:
        """The same run with the fault's fix applied (measured in the same launch)."""
        return self._fixed


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
