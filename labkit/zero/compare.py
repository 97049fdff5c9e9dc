"""Ours next to PyTorch's: ZeRO-1 vs ``ZeroRedundancyOptimizer``, ZeRO-3 vs FSDP2 ``fully_shard``.

:func:`run_side_by_side` runs on every rank (inside :func:`labkit.launch`). For each
contender it trains the same GPT from the same seed on the same batches, and reports
ms/step (median after warm-up, no tracker), peak bytes (one more step under the
tracker, which also follows FSDP's ``storage.resize_``), the loss curve and the bytes our
comm layer sent. The losses of ours and PyTorch's must agree: that is the numerical
cross-check (FSDP on gloo had upstream bugs, pytorch #162338: do not assume, compare).

PyTorch's ZeRO-1 is ``DDP`` (an all-reduce of gradients) + ``ZeroRedundancyOptimizer``
(each rank steps its share of *whole parameters*, then broadcasts them); ours is a
reduce-scatter + all-gather of flat shards. FSDP2 is ZeRO-3 with one unit per
``fully_shard``-ed module (we wrap each transformer block, as ``wrap=blocks`` does for ours).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit.memory import tracker_for
from labkit.models import GPT, GPTConfig, gpt_loss
from labkit.zero.adam import AdamConfig
from labkit.zero.factory import make_optimizer

__all__ = ["CONTENDERS", "run_side_by_side"]

CONTENDERS = ("ours zero1", "torch ZeroRedundancyOptimizer", "ours zero3", "ours zero3 prefetch", "torch FSDP2")


def _setup(name: str, model: nn.Module, cfg: AdamConfig) -> tuple[Callable[[], Any], Callable[[], Any], Any]:
    """(zero_grad, step, our optimizer or None) for contender ``name``; may wrap ``model``."""
    kw: dict[str, Any] = {"lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    blocks = list(model.blocks) if isinstance(model, GPT) else None
    if name.startswith("ours"):
        stage = name.split()[1]
        opt = make_optimizer(stage, model, cfg, wrap=blocks, prefetch=name.endswith("prefetch"))
        return opt.zero_grad, opt.step, opt
    if name == "torch ZeroRedundancyOptimizer":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        zro = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **kw)
        return zro.zero_grad, zro.step, None
    if name == "torch FSDP2":
        from torch.distributed.fsdp import fully_shard

        for block in blocks or []:
            fully_shard(block)
        fully_shard(model)
        adamw = torch.optim.AdamW(model.parameters(), **kw)
        return adamw.zero_grad, adamw.step, None
    raise ValueError(f"unknown contender {name!r}; expected one of {CONTENDERS}")


def run_side_by_side(
    contenders: tuple[str, ...] = CONTENDERS,
    *,
    gpt: GPTConfig | None = None,
    batch: int = 4,
    steps: int = 4,
    warmup: int = 1,
    lr: float = 1e-3,
) -> dict[str, dict[str, Any]]:
    """Per contender on this rank: ``ms_per_step``, ``peak_bytes``, ``losses``, ``sent``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labkit.launch import local_device

    gpt = gpt or GPTConfig(n_layer=4, n_embd=256, n_head=4, block_size=128)
    device = local_device()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = AdamConfig(lr=lr)

    def train(name: str, n_steps: int, mt: Any = None) -> tuple[list[float], list[float], dict[str, int]]:
        torch.manual_seed(0)
        model: nn.Module = GPT(gpt).to(device)
        zero_grad, step, ours = _setup(name, model, cfg)
        fwd = DDP(model) if name == "torch ZeroRedundancyOptimizer" else model
        if mt is not None:
            mt.reset_peak()  # the peak of training, not of building the model
        losses, times = [], []
        for i in range(n_steps):
            g = torch.Generator().manual_seed(1000 * i + rank)  # this rank's share of batch i
            x = torch.randint(0, gpt.vocab_size, (batch, gpt.block_size), generator=g).to(device)
            t0 = time.perf_counter()
            zero_grad()
            loss = gpt_loss(fwd, x, torch.roll(x, -1, 1))
            loss.backward()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
            loss_avg = loss.detach().clone()
            dist.all_reduce(loss_avg)  # the global-batch loss, comparable across contenders
            losses.append(loss_avg.item() / world_size)
        sent = {k: v // n_steps for k, v in ours.comm.sent.items()} if ours is not None else {}
        return losses, times, sent

    out: dict[str, dict[str, Any]] = {}
    for name in contenders:
        with tracker_for(device) as mt:  # model, optimizer and 2 steps (lazy Adam state)
            train(name, 2, mt)
        losses, times, sent = train(name, warmup + steps)  # timed, without the tracker
        out[name] = {
            "ms_per_step": 1e3 * statistics.median(times[warmup:]),
            "peak_bytes": mt.peak_bytes,
            "losses": losses,
            "sent": sent,
        }
    return out
