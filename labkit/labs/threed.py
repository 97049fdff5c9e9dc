"""Lab 08: a tiny GPT trained with data x tensor x pipeline parallelism, checked against one
process.

Three ways to run the same :func:`train`::

    python -m labkit.labs.threed --dp 2 --tp 2 --pp 2                # launches 8 gloo ranks
    torchrun --nproc-per-node 8 -m labkit.labs.threed --dp 2 --tp 2 --pp 2
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 -m labkit.labs.threed --dp 2 --tp 2 --pp 2

Every rank prints nothing but rank 0, which prints one line per step and a final
``checksum`` (the sum of every full parameter, from the ranks holding each stage): the same
number whatever the launcher and however the ranks are spread over nodes.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from labkit.launch import launch, local_device, run_from_env
from labkit.models.gpt import GPT, GPTConfig, lm_loss
from labkit.parallel.layout import ParallelDegrees
from labkit.parallel.threed import ThreeDConfig, build_threed, check_threed
from labkit.zero.adam import AdamConfig

__all__ = ["LabConfig", "TINY", "batch", "main", "reference", "train"]

# vocabulary 64 and 4 heads of 8: divisible by tp = 2 or 4; 4 layers: pp = 2 or 4
TINY = GPTConfig(vocab_size=64, block_size=8, n_layer=4, n_head=4, n_embd=32)
FROZEN = ("wpe.weight",)  # a frozen parameter: must never move, on any rank


@dataclass(frozen=True)
class LabConfig:
    model: GPTConfig = TINY
    threed: ThreeDConfig = ThreeDConfig()
    steps: int = 3
    seq: int = 8
    # eps = 1: the update is nearly proportional to the gradient. With a tiny eps Adam is
    # scale-invariant (a gradient summed instead of averaged would go unseen) and turns the
    # float noise of gradients that are zero in exact arithmetic (the key bias) into +-lr.
    adam: AdamConfig = field(default_factory=lambda: AdamConfig(lr=0.5, eps=1.0))
    seed: int = 0


def batch(cfg: LabConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: tokens and targets of shape (dp * m, b, T)."""
    t = cfg.threed
    g = torch.Generator().manual_seed(1000 * cfg.seed + step)
    n = t.degrees.dp * t.micro_batches
    data = torch.randint(0, cfg.model.vocab_size, (n, t.micro_batch, cfg.seq + 1), generator=g)
    return data[:, :, :-1], data[:, :, 1:]


def build_model(cfg: LabConfig) -> GPT:
    """The lab's GPT, seeded, with the ``FROZEN`` parameters frozen: every run starts here."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in FROZEN)
    return model


def reference(cfg: LabConfig, replicas: int | None = None) -> dict[str, Any]:
    """One process: gradient accumulation over all dp * m micro-batches, torch's AdamW
    (``replicas``: use only the first replicas' micro-batches, a negative control)."""
    model = build_model(cfg)
    a = cfg.adam
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=a.lr, betas=a.betas, eps=a.eps, weight_decay=a.weight_decay,
    )  # fmt: skip
    losses = []
    for step in range(cfg.steps):
        opt.zero_grad(set_to_none=True)
        x, y = batch(cfg, step)
        if replicas is not None:
            x, y = (
                x[: replicas * cfg.threed.micro_batches],
                y[: replicas * cfg.threed.micro_batches],
            )
        total = 0.0
        for xi, yi in zip(x, y):
            loss = lm_loss(model(xi), yi) / len(x)
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "checksum": checksum(params)}


def checksum(params: dict[str, torch.Tensor]) -> float:
    """Sum of every parameter of the full model (the tied head counted once, as ``wte``)."""
    return float(sum(p.double().sum() for n, p in params.items() if n != "head.weight"))


def train(cfg: LabConfig, verbose: bool = False) -> dict[str, Any]:
    """On every rank: train ``cfg.steps`` 3D steps. Returns this rank's losses (averaged over
    dp on the last stage; None elsewhere), its stage's full parameters (tp rank 0 of dp
    replica 0 only, else {}), the step times, and the checksum (rank 0: every stage's)."""
    t = cfg.threed
    device = local_device()  # cuda:LOCAL_RANK under NCCL, else the CPU
    job = build_threed(build_model(cfg).to(device), t, cfg.adam)
    d, m = job.dp_rank, t.micro_batches
    losses, times, parts = [], [], []
    for step in range(cfg.steps):
        x, y = (z.to(device) for z in batch(cfg, step))  # (dp * m, b, T) each
        start = time.perf_counter()
        loss = job.step(list(x[d * m : (d + 1) * m]), list(y[d * m : (d + 1) * m]))
        if device.type == "cuda":  # the step's kernels done before the clock stops
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        parts.append(job.last)
        if loss is not None:  # the dp replicas' mean, for printing and comparing
            mean = torch.tensor([loss], device=device)
            dist.all_reduce(mean, group=job.layout.dp_group)
            loss = mean.item() / t.degrees.dp
        losses.append(loss)
        if verbose and dist.get_rank() == dist.get_world_size() - 1:
            print(f"step {step}: loss {loss:.6f} ({times[-1] * 1e3:.0f} ms)", flush=True)
    full = job.gather_full()
    keep = job.layout.tp_rank == 0 and d == 0
    params = {n: x.cpu() for n, x in full.items()} if keep else {}
    # the checksum: each stage's sum once (tp rank 0 of replica 0), summed over the world
    total = torch.tensor([checksum(params) if keep else 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    job.close()
    return {
        "rank": dist.get_rank(),
        "losses": losses,
        "params": params,
        "times": times,
        "parts": parts,
        "checksum": float(total.item()),
    }


def run(cfg: LabConfig, **launch_options: Any) -> list[dict[str, Any]]:
    """Launch ``train`` on dp * tp * pp local ranks (gloo unless told)."""
    check_threed(cfg.model, cfg.threed, cfg.threed.degrees.world_size)
    launch_options.setdefault("backend", "gloo")
    return launch(train, cfg, world_size=cfg.threed.degrees.world_size, **launch_options)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("dp", 2), ("tp", 2), ("pp", 2), ("micro-batches", 2), ("steps", 3)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--zero", default="ddp", choices=["ddp", "zero1"])
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--backend", default="gloo", help="gloo (CPU) or nccl (one GPU a rank)")
    args = parser.parse_args(argv)
    degrees = ParallelDegrees(args.dp, args.tp, args.pp)
    three = ThreeDConfig(degrees, args.micro_batches, schedule=args.schedule, zero=args.zero)
    cfg = LabConfig(threed=three, steps=args.steps)
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        check_threed(cfg.model, three, int(os.environ["WORLD_SIZE"]))
        result = run_from_env(train, cfg, True, backend=args.backend)
        if result["rank"] == 0:
            print(f"checksum {result['checksum']:.10f}", flush=True)
        return
    results = run(cfg, backend=args.backend, timeout=600)
    print(f"checksum {results[0]['checksum']:.10f}")


if __name__ == "__main__":
    main()
