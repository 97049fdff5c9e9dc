"""The fault drill: a small data-parallel GPT run that checkpoints, can be killed, and resumes.

``run_drill(cfg, ckpt_dir, world_size)`` trains a tiny GPT on tiny-shakespeare for
``cfg.steps`` steps, saving a sharded checkpoint every ``cfg.ckpt_every`` steps. At start it
resumes from the newest committed checkpoint under ``ckpt_dir``, if there is one.
``cfg.kill_rank`` / ``cfg.kill_at_step`` make one rank SIGKILL itself once (a marker file
remembers that it already did): mid-step, or with ``kill_in_save`` between writing its shard
and the commit. Relaunch (or ``max_restarts=1``) and the run resumes.

What "continue training identically" requires -- every input of a step must be restored:

* model, optimizer (Adam moments, step counts) and loss-scaler state: the checkpoint;
* the data order: the sampler is a pure function of (seed, step), so its position is one
  integer, the step;
* randomness (dropout): in ``dp`` mode each rank draws from its own RNG stream, so each
  rank's stream state is saved and restored -- which only works on the same world size.
  In ``reshardable`` mode each *sample* seeds its own draw from (seed, step, sample), so no
  stream state is needed and the world size may change;
* the order of floating-point additions: ``all_reduce`` over 4 ranks adds the gradients in
  a different order than over 3, and fp32 addition is not associative, so results differ in
  the last bits. ``reshardable`` mode computes one gradient per sample, all-gathers them and
  sums them in global sample order: the same bits on any world size (at the price of
  per-sample backward passes and an all_gather -- a determinism device, not a fast path).
"""

from __future__ import annotations

import functools
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from labkit.checkpoint import latest_step, load_checkpoint, save_checkpoint
from labkit.launch import launch, local_device
from labkit.precision.loss_scaler import DynamicLossScaler
from labkit.safe_files import write_private

__all__ = ["DrillConfig", "run_drill", "train"]


@dataclass
class DrillConfig:
    steps: int = 8
    global_batch: int = 12  # divisible by 1, 2, 3, 4, 6: reshards to any of them
    ckpt_every: int = 2
    keep: int = 2
    seed: int = 0
    lr: float = 3e-3
    block_size: int = 16
    n_layer: int = 2
    n_embd: int = 32
    n_head: int = 2
    dropout: float = 0.1
    reshardable: bool = False  # per-sample RNG + fixed-order gradient sum (see module doc)
    # steps whose gradients get an inf: skipped, the scale backs off
    overflow_at: tuple[int, ...] = (3,)
    kill_rank: int | None = None
    kill_at_step: int | None = None
    kill_in_save: bool = False  # kill between the shard write and the commit of that step's save
    kill_marker: str | None = None  # file created just before the kill: kill only once

    def validate(self, world_size: int) -> None:
        if self.steps < 1 or self.ckpt_every < 1 or self.keep < 1:
            raise ValueError(
                "steps, ckpt_every, keep must be >= 1, "
                f"got {self.steps}, {self.ckpt_every}, {self.keep}"
            )
        if self.global_batch % world_size:
            raise ValueError(
                f"global_batch={self.global_batch} is not divisible by world_size={world_size}"
            )
        if self.kill_rank is not None:
            if not 0 <= self.kill_rank < world_size:
                raise ValueError(
                    f"kill_rank={self.kill_rank} is not a rank of world_size={world_size}"
                )
            if self.kill_at_step is None or self.kill_marker is None:
                raise ValueError(
                    "kill_rank needs kill_at_step and kill_marker (so the kill happens once)"
                )
            if self.kill_in_save and self.kill_at_step % self.ckpt_every:
                raise ValueError(f"kill_in_save: no save happens at step {self.kill_at_step}")


def _kill_once(cfg: DrillConfig, rank: int, step: int, in_save: bool) -> None:
    if cfg.kill_rank != rank or cfg.kill_at_step != step or cfg.kill_in_save != in_save:
        return
    marker = Path(str(cfg.kill_marker))
    if marker.exists():  # already killed once: this is the restarted run
        return
    write_private(marker, f"rank {rank} killed at step {step}{' during save' if in_save else ''}\n")
    os.kill(os.getpid(), signal.SIGKILL)  # no exception, no cleanup: like a lost machine


def _flat_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])  # (P,)


def _set_flat_grads(model: torch.nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for p in model.parameters():
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()  # (n,) -> p.shape
        offset += n


def train(cfg: DrillConfig, ckpt_dir: str) -> dict[str, Any]:
    """One rank of the drill (run it with ``launch`` / :func:`run_drill`)."""
    from labkit.data.shakespeare import CharDataset
    from labkit.models import GPT, GPTConfig, gpt_loss

    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = local_device()
    data = CharDataset(cfg.block_size, "train")
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = GPT(
        GPTConfig(
            vocab_size=data.vocab_size,
            block_size=cfg.block_size,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            n_embd=cfg.n_embd,
            dropout=cfg.dropout,
        )
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    scaler = DynamicLossScaler(init_scale=2.0**8, growth_interval=2)
    # the sampler
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(cfg.seed))
    torch.manual_seed(cfg.seed * 1000 + 1 + rank)  # dp mode: each rank its own dropout stream

    step, resumed_from = 0, None
    if latest_step(ckpt_dir) is not None:
        ckpt = load_checkpoint(ckpt_dir)
        ckpt.expect({k: tuple(v.shape) for k, v in model.state_dict().items()}, "/model/")
        state = ckpt.state()
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        scaler.load_state_dict(state["scaler"])
        step = resumed_from = state["sampler"]["step"]
        mine = ckpt.rank_state(rank, world_size)
        if mine is not None:
            torch.set_rng_state(mine["rng_cpu"])
            if device.type == "cuda":
                torch.cuda.set_rng_state(mine["rng_cuda"], device)
        elif not cfg.reshardable:
            raise ValueError(
                f"checkpoint saved on {ckpt.world_size} ranks, loading on {world_size}: "
                "dp mode keeps one RNG stream per rank, which cannot be resharded; "
                "use reshardable=True"
            )

    per_rank = cfg.global_batch // world_size
    losses, scales = [], []
    while step < cfg.steps:
        batch = order[step * cfg.global_batch : (step + 1) * cfg.global_batch]  # global sample ids
        positions = range(rank * per_rank, (rank + 1) * per_rank)  # this rank's part of the batch
        model.zero_grad(set_to_none=True)
        if cfg.reshardable:
            rows, loss_sum = [], 0.0
            for pos in positions:
                x, y = (t.unsqueeze(0).to(device) for t in data[int(batch[pos])])  # (1, T)
                torch.manual_seed(cfg.seed * 1_000_003 + step * cfg.global_batch + pos)
                loss = gpt_loss(model, x, y)
                scaler.scale(loss / cfg.global_batch).backward()
                rows.append(_flat_grads(model))
                loss_sum += loss.item()
                model.zero_grad(set_to_none=True)
            mine_rows = torch.stack(rows)  # (per_rank, P)
            _kill_once(cfg, rank, step, in_save=False)  # mid-step: the peers wait in all_gather
            parts = [torch.empty_like(mine_rows) for _ in range(world_size)]
            dist.all_gather(parts, mine_rows)
            flat = torch.cat(parts)  # W x (per_rank, P) -> (G, P), in global sample order
            grad = flat[0].clone()
            for row in flat[1:]:  # a fixed left-to-right order, whatever the world size
                grad += row
            local_loss = loss_sum / per_rank
        else:
            xs, ys = zip(*(data[int(batch[pos])] for pos in positions))
            x, y = torch.stack(xs).to(device), torch.stack(ys).to(device)  # (per_rank, T)
            loss = gpt_loss(model, x, y)
            scaler.scale(loss).backward()
            grad = _flat_grads(model)
            _kill_once(cfg, rank, step, in_save=False)  # mid-step: the peers wait in all_reduce
            dist.all_reduce(grad)
            grad /= world_size
            local_loss = loss.item()
        if step in cfg.overflow_at and rank == 0:
            grad[0] = float("inf")  # an injected overflow: every rank must skip this step
        _set_flat_grads(model, grad)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        losses.append(local_loss)
        step += 1
        if step % cfg.ckpt_every == 0 or step == cfg.steps:
            rng = {"rng_cpu": torch.get_rng_state()}
            if device.type == "cuda":
                rng["rng_cuda"] = torch.cuda.get_rng_state(device)
            state = {
                "model": model.state_dict(),
                "optim": opt.state_dict(),
                "scaler": scaler.state_dict(),
                "sampler": {"seed": cfg.seed, "step": step},
            }
            save_checkpoint(
                ckpt_dir,
                step,
                state,
                rank_state=rng,
                keep=cfg.keep,
                before_commit=functools.partial(_kill_once, cfg, rank, step, True),
            )
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])  # (P,)
    return {"params": params, "resumed_from": resumed_from, "scaler": scaler.state_dict(),
            "scales": scales, "losses": losses}  # fmt: skip


def run_drill(
    cfg: DrillConfig, ckpt_dir: str | Path, world_size: int = 2, **launch_options: Any
) -> list[dict[str, Any]]:
    """Validate, then run :func:`train` on ``world_size`` ranks; per-rank results."""
    cfg.validate(world_size)
    launch_options.setdefault("quiet", True)
    launch_options.setdefault("timeout", 120.0)
    return launch(train, cfg, str(ckpt_dir), world_size=world_size, **launch_options)
