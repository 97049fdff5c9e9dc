"""Lab 01: a CNN on MNIST with data parallelism (PyTorch's DistributedDataParallel).

Three ways to run the same :func:`train`::

    python -m labkit.labs.mnist                         # launches 2 ranks via labkit.launch
    python -m labkit.labs.mnist --world-size 1          # one process
    torchrun --nproc-per-node 2 -m labkit.labs.mnist    # torchrun starts the ranks

The run's settings (:class:`MnistConfig`) and its batch and learning-rate arithmetic
(effective batch, linear scaling, warmup) are in ``mnist_config.py``, re-exported here.

``sync="none"`` trains the ranks *without* gradient averaging (each on its own shard,
from the same start): the lab shows their parameters drift apart after the first step.
``sync="labkit"`` uses labkit's :class:`~labkit.ddp.OverlappedDDP`, which takes a gradient
``compression`` ("fp16", "bf16", "powersgd<r>", "powersgd<r>-noef"; see
:mod:`labkit.ddp.compression`): ``labkit.measure.compression`` compares their accuracy
and bytes per step.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit.collectives.comm import Comm
from labkit.data.mnist import MNIST
from labkit.data.sampler import DistributedSampler, make_loader
from labkit.ddp import DataParallel, OverlappedDDP
from labkit.ddp.compression import COMPRESSIONS, make_compression
from labkit.labs.mnist_config import SYNCS, MnistConfig, effective_batch, lr_at, scaled_lr
from labkit.launch import World, launch, local_device, run_from_env, seed_everything
from labkit.models import MnistCNN

__all__ = [
    "SYNCS",
    "MnistConfig",
    "effective_batch",
    "evaluate",
    "lr_at",
    "main",
    "run",
    "run_many",
    "scaled_lr",
    "train",
    "train_here",
]


def _progress(step: int, total: int, loss: float, rate: float, width: int = 20) -> str:
    done = int(width * step / max(total, 1))
    bar = "#" * done + "." * (width - done)
    return f"[{bar}] step {step}/{total}  loss {loss:.3f}  {rate:,.0f} img/s"


def _max_diff_to_rank0(model: nn.Module, group: Any) -> float:
    """max |theta - theta_rank0| over all parameters (0.0 means bit-identical)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])  # (num_params,)
    ref = flat.clone()
    dist.broadcast(ref, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return float((flat - ref).abs().max())


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data: MNIST,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
    group: Any = None,
) -> float:
    """Accuracy on ``data``, each rank scoring the samples ``rank, rank + W, ...`` (no padding)."""
    model.eval()
    x, y = data.images[rank::world_size].to(device), data.labels[rank::world_size].to(device)
    correct = torch.tensor([0.0, 0.0], device=device)
    for i in range(0, len(y), 500):
        pred = model(x[i : i + 500]).argmax(1)
        correct += torch.tensor([(pred == y[i : i + 500]).sum().item(), len(pred)], device=device)
    if world_size > 1:
        dist.all_reduce(correct, group=group)
    model.train()
    return float(correct[0] / correct[1])


def train(cfg: MnistConfig, group: Any = None) -> dict[str, Any]:
    """Train on this rank (a world of one when torch.distributed is not initialised).

    Returns: ``accuracy`` (validation), ``losses`` (per step, this rank's), ``lrs``,
    ``step_times`` (seconds), ``throughput`` (images/s over all ranks, first steps excluded),
    ``max_diff`` (per step, when ``check_sync``), ``effective_batch``, ``bytes_per_step``
    (gradient bytes this rank sent per step, counted by labkit's ``Comm``; None for torch DDP
    and one rank).
    """
    distributed = dist.is_initialized()
    rank = dist.get_rank(group) if distributed else 0
    world = dist.get_world_size(group) if distributed else 1
    if distributed:
        device = local_device()
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    seed_everything(cfg.seed + rank)  # different on purpose: DDP's broadcast makes them agree
    train_set = MNIST("train", root=cfg.data_root, limit=cfg.train_limit)
    val_set = MNIST("val", root=cfg.data_root)
    sampler = DistributedSampler(len(train_set), rank, world, seed=cfg.seed, drop_last=True)
    loader = make_loader(train_set, cfg.batch_size, sampler, device=device)

    model: nn.Module = MnistCNN(channels=cfg.channels).to(device)
    net = model
    comm = None
    if world > 1 and cfg.sync == "labkit":
        comm = Comm(group)
        net = OverlappedDDP(model, comm=comm, compression=make_compression(cfg.compression))
    elif world > 1 and cfg.sync == "torch_ddp":
        net = DDP(
            model, device_ids=[device.index] if device.type == "cuda" else None, process_group=group
        )
    elif world > 1:  # same start, then no communication at all
        for p in model.parameters():
            dist.broadcast(
                p.data, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group
            )
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)

    micro_per_epoch = len(loader)
    total_steps = int(cfg.epochs * micro_per_epoch) // cfg.accum
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    out: dict[str, Any] = {"losses": [], "lrs": [], "step_times": [], "max_diff": [], "rank": rank}
    out["effective_batch"] = effective_batch(cfg.batch_size, world, cfg.accum)
    step, epoch, micro = 0, 0, 0
    step_loss = torch.zeros((), device=device)
    t_step = time.perf_counter()
    while step < total_steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            last = (micro + 1) % cfg.accum == 0
            sync_ctx: Any = contextlib.nullcontext()
            if isinstance(net, (DDP, DataParallel)) and not last:
                sync_ctx = net.no_sync()
            with sync_ctx:
                loss = F.cross_entropy(net(x), y) / cfg.accum
                loss.backward()
            step_loss = loss.detach() if micro % cfg.accum == 0 else step_loss + loss.detach()
            micro += 1
            if not last:
                continue
            if isinstance(net, OverlappedDDP):
                net.finish_gradient_sync()  # torch DDP does this inside backward
            for group_ in opt.param_groups:
                group_["lr"] = lr_at(step, cfg.lr, cfg.warmup_steps)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cfg.check_sync and world > 1:
                out["max_diff"].append(_max_diff_to_rank0(model, group))
            now = time.perf_counter()
            out["step_times"].append(now - t_step)
            t_step = now
            if world > 1:  # log the loss of the whole effective batch, not just this rank's part
                dist.all_reduce(step_loss, group=group)
                step_loss /= world
            out["losses"].append(step_loss.item())
            out["lrs"].append(opt.param_groups[0]["lr"])
            step += 1
            if (
                cfg.progress
                and rank == 0
                and (step % max(1, total_steps // 5) == 0 or step == total_steps)
            ):
                recent = out["step_times"][-5:]
                rate = out["effective_batch"] * len(recent) / max(sum(recent), 1e-9)
                print(_progress(step, total_steps, out["losses"][-1], rate), flush=True)
            if step >= total_steps:
                break
        epoch += 1
    timed = out["step_times"][min(3, len(out["step_times"]) - 1) :]  # skip warm-up steps
    out["throughput"] = out["effective_batch"] * len(timed) / max(sum(timed), 1e-9)
    out["bytes_per_step"] = None if comm is None else comm.total_sent / max(step, 1)
    # Unsynchronised ranks hold different models: each scores the whole validation set.
    if cfg.sync != "none":
        out["accuracy"] = evaluate(model, val_set, device, rank, world, group)
    else:
        out["accuracy"] = evaluate(model, val_set, device)
    return out


def run(
    cfg: MnistConfig, world_size: int = 2, *, world: World | None = None, **launch_options: Any
) -> list[dict[str, Any]]:
    """:func:`train` on ``world_size`` ranks via :func:`labkit.launch`; per-rank results.

    With ``world`` (a warm :class:`labkit.World` of ``world_size`` ranks) the same function
    runs on its ranks instead of a fresh launch: a notebook pays the start-up once."""
    launch_options.setdefault("timeout", 600)
    return _on_ranks(train, cfg, world_size, world, launch_options)


def _on_ranks(
    fn: Any, arg: Any, world_size: int, world: World | None, options: dict[str, Any]
) -> Any:
    if world is None:
        return launch(fn, arg, world_size=world_size, **options)
    if world.cfg.world_size != world_size:
        raise ValueError(
            f"world has {world.cfg.world_size} ranks but world_size={world_size}: pass the same"
        )
    return world.run(fn, arg, **options)


def _train_each(cfgs: list[MnistConfig], group: Any = None) -> list[dict[str, Any]]:
    return [train(cfg, group) for cfg in cfgs]


def run_many(
    cfgs: list[MnistConfig],
    world_size: int = 2,
    *,
    world: World | None = None,
    **launch_options: Any,
) -> list[list[dict[str, Any]]]:
    """Several short runs in ONE launch (a launch costs ~3 s), or one call on ``world``.

    Returns ``result[i][rank]`` for ``cfgs[i]``."""
    launch_options.setdefault("timeout", 600)
    per_rank = _on_ranks(_train_each, cfgs, world_size, world, launch_options)
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(cfgs))]


def train_here(cfg: MnistConfig, threads: int | None = None) -> dict[str, Any]:
    """One process, in the caller (no launch): the 1-rank baseline, with ``threads`` cores."""
    if dist.is_initialized():
        raise RuntimeError("train_here runs without torch.distributed; inside a rank, call train()")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        return train(cfg)
    finally:
        torch.set_num_threads(previous)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = MnistConfig()
    parser.add_argument(
        "--world-size", type=int, default=2, help="ranks to launch (ignored under torchrun)"
    )
    for name in ("epochs", "lr"):
        parser.add_argument(f"--{name}", type=float, default=getattr(d, name))
    for name in ("batch_size", "accum", "warmup_steps", "channels", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--train-limit", type=int, default=None)
    parser.add_argument(
        "--data-root", default=None, help="folder with the full 60k MNIST IDX files"
    )
    parser.add_argument("--sync", default=d.sync, choices=list(SYNCS))
    parser.add_argument("--compression", default=d.compression, help=f"one of {COMPRESSIONS}")
    args = vars(parser.parse_args(argv))
    world_size = args.pop("world_size")
    cfg = MnistConfig(**args)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun: this process is one rank
        result = run_from_env(train, cfg)
        if result["rank"] == 0:
            print(f"validation accuracy {result['accuracy']:.4f}")
        return
    results = run(cfg, world_size) if world_size > 1 else [train(cfg)]
    r0 = results[0]
    sent = r0.get("bytes_per_step")
    print(
        f"world_size={world_size} effective batch {r0['effective_batch']}: validation accuracy "
        f"{r0['accuracy']:.4f}, {r0['throughput']:,.0f} img/s"
        + ("" if sent is None else f", {sent:,.0f} gradient bytes sent per step")
    )


if __name__ == "__main__":
    main()
