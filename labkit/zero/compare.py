"""Ours next to PyTorch's: ZeRO-1 vs ``ZeroRedundancyOptimizer``, ZeRO-3 vs FSDP2 ``fully_shard``.

:func:`run_side_by_side` runs on every rank (inside :func:`labkit.launch`). Every contender
trains the same GPT from the same seed on the same batches. Timing: the contenders step
*interleaved*, round by round (:func:`labkit.measure.timing.interleaved_times`, a barrier
before and after each step), so a burst of load from elsewhere hits them alike; warm-up
rounds are dropped and the median is reported with its spread. Memory: one more short run
per contender under the tracker (which also follows FSDP's ``storage.resize_``). The losses
of ours and PyTorch's must agree: that is the numerical cross-check (FSDP on gloo had
upstream bugs, pytorch #162338: do not assume, compare).

PyTorch's ZeRO-1 is ``DDP`` (an all-reduce of gradients, 2Psi) + ``ZeroRedundancyOptimizer``
(each rank steps its share of *whole parameters*, then broadcasts them: another Psi, so
about 3Psi in all); ours is a reduce-scatter + all-gather of flat shards (2Psi). FSDP2 is
ZeRO-3 with one unit per ``fully_shard``-ed module (we wrap each transformer block, as
``wrap=blocks`` does for ours). torch's AdamW runs with ``foreach=True`` (one multi-tensor
kernel per op, like ours on flat buffers), so the ratio compares sharding, not loop overhead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit.measure.timing import interleaved_times, spread
from labkit.memory import tracker_for
from labkit.models import GPT, GPTConfig, gpt_loss
from labkit.zero.adam import AdamConfig
from labkit.zero.factory import make_optimizer

__all__ = ["CONTENDERS", "run_side_by_side"]

CONTENDERS = (
    "ours zero1",
    "torch ZeroRedundancyOptimizer",
    "ours zero3",
    "ours zero3 prefetch",
    "torch FSDP2",
)


def _setup(name: str, model: nn.Module, cfg: AdamConfig) -> tuple[nn.Module, Any, Any]:
    """(module to call, optimizer with zero_grad/step, our optimizer or None) for ``name``."""
    kw: dict[str, Any] = {
        "lr": cfg.lr,
        "betas": cfg.betas,
        "eps": cfg.eps,
        "weight_decay": cfg.weight_decay,
        "foreach": True,
    }
    blocks = list(model.blocks) if isinstance(model, GPT) else None
    if name.startswith("ours"):
        stage = name.split()[1]
        opt = make_optimizer(stage, model, cfg, wrap=blocks, prefetch=name.endswith("prefetch"))
        return model, opt, opt
    if name == "torch ZeroRedundancyOptimizer":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        zro = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **kw)
        return DDP(model), zro, None
    if name == "torch FSDP2":
        from torch.distributed.fsdp import fully_shard

        for block in blocks or []:
            fully_shard(block)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), **kw), None
    raise ValueError(f"unknown contender {name!r}; expected one of {CONTENDERS}")


def run_side_by_side(
    contenders: tuple[str, ...] = CONTENDERS,
    *,
    gpt: GPTConfig | None = None,
    batch: int = 4,
    steps: int = 20,
    warmup: int = 3,
    lr: float = 1e-3,
) -> dict[str, dict[str, Any]]:
    """Per contender on this rank: ``ms_per_step`` (median), ``spread`` (min/median/max
    seconds), ``peak_bytes``, ``losses`` (global-batch loss of every step), ``sent``."""
    from labkit.launch import local_device

    bad = [c for c in contenders if c not in CONTENDERS]
    if bad or steps < 1 or warmup < 0:
        raise ValueError(
            f"need contenders from {CONTENDERS}, steps >= 1, warmup >= 0; "
            f"got {bad or contenders}, steps={steps}, warmup={warmup}"
        )
    gpt = gpt or GPTConfig(n_layer=4, n_embd=256, n_head=4, block_size=128)
    device = local_device()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = AdamConfig(lr=lr)

    def batch_for(i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * i + rank)  # this rank's share of batch i
        return torch.randint(0, gpt.vocab_size, (batch, gpt.block_size), generator=g).to(device)

    def trainer(name: str) -> tuple[Callable[[], None], list[torch.Tensor], Any]:
        torch.manual_seed(0)
        fwd, opt, ours = _setup(name, GPT(gpt).to(device), cfg)
        losses: list[torch.Tensor] = []

        def one_step() -> None:
            x = batch_for(len(losses))  # (batch, T) token ids
            opt.zero_grad()
            loss = gpt_loss(fwd, x, torch.roll(x, -1, 1))
            loss.backward()
            opt.step()
            losses.append(loss.detach())

        return one_step, losses, ours

    peaks = {}
    for name in contenders:
        with tracker_for(device) as mt:  # model, optimizer and 2 steps (lazy Adam state)
            one_step, _, _ = trainer(name)
            mt.reset_peak()  # the peak of training, not of building the model
            one_step()
            one_step()
            peaks[name] = mt.peak_bytes
        del one_step

    runs = {name: trainer(name) for name in contenders}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()  # every rank starts and ends each contender's step together

    times = interleaved_times({n: r[0] for n, r in runs.items()}, steps, warmup, sync=sync)
    out: dict[str, dict[str, Any]] = {}
    for name, (_, losses, ours) in runs.items():
        global_losses = torch.stack(losses)
        dist.all_reduce(global_losses)  # the global-batch loss, comparable across contenders
        out[name] = {
            "ms_per_step": 1e3 * spread(times[name]).median,
            "spread": spread(times[name]),
            "peak_bytes": peaks[name],
            "losses": (global_losses / world_size).tolist(),
            "sent": {k: v // len(losses) for k, v in ours.comm.sent.items()} if ours else {},
        }
    return out
