"""Scaling records: what a learner measures at 1..4 ranks, and what it implies.

A :class:`ScalingRun` is one measured configuration: ranks, the median step time and the
global batch. Two ways to scale (the vocabulary of every scaling study):

* **strong** scaling keeps the global batch fixed: ideal step time ``t1 / N``, speed-up
  ``t1 / tN``;
* **weak** scaling keeps the per-rank batch fixed (global batch ``N * b``): ideal step time
  ``t1``, speed-up ``throughput_N / throughput_1``.

Efficiency is speed-up over ``N``. Derived numbers: MFU (model FLOPs per second over the
hardware's peak; PaLM, Chowdhery et al. 2022, appendix B), GPU-hours per million samples
(``N / throughput * 1e6 / 3600``) and time-to-accuracy (first time a run reaches a target).

:func:`extrapolate` continues a measured 1-rank step to 8..1,024 GPUs with the alpha-beta
model of :mod:`labkit.collectives.cost_model`: data-parallel step time = compute (``t1``
weak, ``t1 / N`` strong) + a ring all-reduce of the gradients, not overlapped (an upper
bound on the communication's cost; overlap can hide up to the backward's length).
:func:`measure_scaling` produces the records with real processes (torch DDP on gloo).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from labkit.collectives.cost_model import AlphaBeta, ring_all_reduce_time
from labkit.hardware import value
from labkit.safe_files import replace_private

__all__ = [
    "LINKS",
    "MODES",
    "ScalingRun",
    "efficiency",
    "extrapolate",
    "gpu_hours_per_million",
    "load_runs",
    "measure_scaling",
    "mfu",
    "save_runs",
    "speedup",
    "time_to_accuracy",
]

MODES = ("strong", "weak")

# Link assumptions for the extrapolation (alpha: per-message latency, beta: 1/bandwidth per
# rank's link), read from the hardware catalog (data sheets and stated latencies, sources
# there); the labels name the catalog's figures.
LINKS: dict[str, AlphaBeta] = {
    "NVLink 4 (450 GB/s)": AlphaBeta(value("link.nvlink_latency"),
                                     1 / value("h100.nvlink_per_direction")),
    "InfiniBand NDR (50 GB/s)": AlphaBeta(value("link.ib_latency"),
                                          1 / value("h100.nic_bandwidth")),
    "Ethernet 100 Gb/s (12.5 GB/s)": AlphaBeta(value("link.ethernet_latency"),
                                               1 / value("link.ethernet100")),
    "Ethernet 10 Gb/s (1.25 GB/s)": AlphaBeta(value("link.ethernet_latency"),
                                              1 / value("link.ethernet10")),
}  # fmt: skip


@dataclass(frozen=True)
class ScalingRun:
    """One measured configuration: ``ranks`` processes took ``step_time`` seconds (median)
    for a step of ``global_batch`` samples."""

    ranks: int
    step_time: float
    global_batch: int
    mode: str = "strong"
    label: str = ""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.ranks < 1 or self.step_time <= 0 or self.global_batch < 1:
            raise ValueError(f"need ranks >= 1, step_time > 0, global_batch >= 1, got {self}")

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return self.global_batch / self.step_time


def _base(runs: Sequence[ScalingRun]) -> ScalingRun:
    modes = {r.mode for r in runs}
    if len(modes) != 1:
        raise ValueError(f"mix of scaling modes {sorted(modes)}: pass one mode's runs")
    ones = [r for r in runs if r.ranks == 1]
    if not ones:
        raise ValueError(
            f"no 1-rank run among ranks {sorted(r.ranks for r in runs)}: it is the baseline"
        )
    return ones[0]


def speedup(runs: Sequence[ScalingRun]) -> dict[int, float]:
    """``{ranks: speed-up}`` against the 1-rank run (see the module doc for the two modes)."""
    base = _base(runs)
    return {r.ranks: r.throughput / base.throughput for r in runs}


def efficiency(runs: Sequence[ScalingRun]) -> dict[int, float]:
    """``{ranks: speed-up / ranks}``: 1.0 is ideal."""
    return {n: s / n for n, s in speedup(runs).items()}


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float, gpus: int = 1) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over ``gpus`` times the peak."""
    if peak_flops <= 0 or gpus < 1:
        raise ValueError(f"need peak_flops > 0 and gpus >= 1, got {peak_flops}, {gpus}")
    return tokens_per_s * flops_per_token / (peak_flops * gpus)


def gpu_hours_per_million(samples_per_s: float, gpus: int) -> float:
    """GPU-hours to process one million samples at ``samples_per_s`` on ``gpus`` GPUs."""
    if samples_per_s <= 0:
        raise ValueError(f"samples_per_s must be > 0, got {samples_per_s}")
    return gpus * 1e6 / samples_per_s / 3600


def time_to_accuracy(history: Iterable[tuple[float, float]], target: float) -> float | None:
    """First time (seconds) in ``history`` of ``(seconds, accuracy)`` with accuracy >= target."""
    for seconds, acc in history:
        if acc >= target:
            return seconds
    return None


def extrapolate(
    base: ScalingRun,
    grad_bytes: float,
    link: AlphaBeta,
    ranks: Sequence[int] = (8, 16, 32, 64, 128, 256, 512, 1024),
) -> list[ScalingRun]:
    """Predicted runs at ``ranks`` from the measured 1-rank ``base`` (module doc's model)."""
    if base.ranks != 1:
        raise ValueError(f"extrapolate from the 1-rank run, got ranks={base.ranks}")
    out = []
    for n in ranks:
        compute = base.step_time / n if base.mode == "strong" else base.step_time
        comm = ring_all_reduce_time(grad_bytes, n, link.alpha, link.beta)
        batch = base.global_batch if base.mode == "strong" else base.global_batch * n
        out.append(ScalingRun(n, compute + comm, batch, base.mode, "alpha-beta"))
    return out


def save_runs(runs: Iterable[ScalingRun], path: str | Path) -> None:
    """Keep the records as a small JSON file (one list of runs)."""
    text = json.dumps([asdict(r) for r in runs], indent=1)
    replace_private(path, text, perm=0o644)  # whole or not at all; never through a link


def load_runs(path: str | Path) -> list[ScalingRun]:
    return [ScalingRun(**d) for d in json.loads(Path(path).read_text())]


def _timed_ddp_steps(
    cfg: Any, per_rank_batch: int, steps: int, warmup: int, group: Any = None
) -> float:
    """On each rank of ``group``: median seconds per DDP step of a labkit GPT (torch DDP)."""
    import statistics

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labkit.models import GPT, gpt_loss

    torch.manual_seed(0)
    model = DDP(GPT(cfg), process_group=group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(0, cfg.vocab_size, (per_rank_batch, cfg.block_size), generator=g)
    times = []
    for i in range(warmup + steps):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        gpt_loss(model, x, torch.roll(x, -1, 1)).backward()
        opt.step()
        dist.barrier(group=group)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _scaling_ranks(
    cfg: Any, per_rank: dict[int, int], steps: int, warmup: int
) -> dict[int, float]:
    """On every rank of the largest world: for each rank count ``n``, ranks ``0 .. n-1`` form
    a group and time their DDP steps while the others wait at a barrier of the whole job;
    ``{n: this rank's median}`` for the groups it is in."""
    import torch.distributed as dist

    out = {}
    for n, batch in per_rank.items():
        group = dist.new_group(list(range(n)))  # every rank takes part in creating it
        if dist.get_rank() < n:
            out[n] = _timed_ddp_steps(cfg, batch, steps, warmup, group)
        dist.barrier()
    return out


def measure_scaling(
    cfg: Any,
    ranks: Sequence[int] = (1, 2),
    *,
    mode: str = "weak",
    batch: int = 4,
    steps: int = 4,
    warmup: int = 1,
    timeout: float = 120,
) -> list[ScalingRun]:
    """Measure DDP steps of ``GPT(cfg)`` at each rank count, in one launch of ``max(ranks)``
    gloo ranks (a fresh world per count would cost seconds of start-up each); a count's time
    is the slowest of its ranks' medians.

    ``batch``: per-rank batch for weak scaling, global batch for strong (must divide).
    """
    from labkit.launch import launch

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    bad = [n for n in ranks if n < 1 or (mode == "strong" and batch % n)]
    if bad:
        raise ValueError(
            f"ranks {bad}: every rank count must be >= 1 (and divide the global batch {batch} "
            f"in strong scaling)"
        )
    per_rank = {n: batch // n if mode == "strong" else batch for n in ranks}
    # one thread per rank: N ranks on N cores compare fairly with 1 rank on 1 core (and
    # OpenMP's spinning threads do not fight over cores the other ranks use)
    res = launch(
        _scaling_ranks, cfg, per_rank, steps, warmup, world_size=max(ranks), backend="gloo",
        timeout=timeout, quiet=True, threads_per_rank=1,
    )  # fmt: skip
    return [
        ScalingRun(n, max(r[n] for r in res if n in r), b * n, mode, "measured")
        for n, b in per_rank.items()
    ]
