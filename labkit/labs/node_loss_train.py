"""What runs on each rank of the node-loss drill (:mod:`labkit.labs.node_loss`), under torchrun.

``torchrun --nnodes 2:3 --rdzv-backend c10d --max-restarts 2 -m labkit.labs.node_loss_train
--config JSON`` starts one worker per rank. It trains a tiny GPT with ZeRO-1 (each rank holds
the AdamW moments of its flat range only) and saves a sharded checkpoint every ``ckpt_every``
steps, asynchronously by default (:class:`AsyncSaver`: the loop stalls for a snapshot only).
It keeps no restart loop: when a peer dies the step's collective fails, the worker raises,
and torchrun's elastic agent re-runs the rendezvous and starts fresh workers on the nodes
that are left. Those read the newest checkpoint and go on.

The invariants that make the curve after the failure equal a run that never failed:

* **the global batch is fixed**: ``global_batch = dp * micro_batch * accumulation``. With
  ``G = 12`` and ``b = 2``: dp 3 accumulates 2 micro-batches, dp 2 accumulates 3;
  :func:`schedule` computes it and refuses a dp that cannot keep ``G``;
* **the data is a function of (seed, step)**: :func:`batch` returns the step's ``G`` samples;
  rank ``r`` of ``dp`` takes samples ``[r * G/dp, (r + 1) * G/dp)``, so the sampler's state is
  the step number, which the checkpoint holds;
* **ZeRO-1 shards are flat ranges** ``shard_range(P, r, dp)``, the partition the checkpoint
  writes by (:mod:`labkit.checkpoint`): rank ``r``'s moments are saved by rank ``r`` alone, and
  a rank of the new dp reads its new range from whichever old shards overlap it (resharding).

The step (rank ``r``, ``dp`` ranks, ``a`` micro-batches of ``b``)::

    g_r = sum_j grad(mean loss of micro-batch j) * b / G        (P,)   local accumulation
    g   = all_reduce_sum(g_r)                                    (P,)   the global mean's grad
    AdamW on [start_r, end_r) of (params, g, m, v)               ZeRO-1: my range only
    params = all_reduce_sum(my range, zeros elsewhere)           (P,)   x + 0 is exact

:func:`reference` runs the same arithmetic in one process, rank by rank, summing the ranks'
gradients in rank order: with dp 2 (``a + b = b + a``) it is the same bits as gloo's sum.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from labkit.checkpoint import (
    Checkpoint,
    latest_step,
    load_checkpoint,
    save_checkpoint,
    shard_range,
)
from labkit.models.gpt import GPT, GPTConfig, lm_loss
from labkit.safe_files import make_private_dir, open_private
from labkit.zero.adam import AdamConfig, adamw_

__all__ = ["AsyncSaver", "NodeLossConfig", "SyncSaver", "batch", "reference", "schedule", "train"]

MODEL = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
ADAM = AdamConfig(lr=3e-2, weight_decay=0.0)


@dataclass(frozen=True)
class NodeLossConfig:
    """The drill's training run. ``collective_timeout``: seconds a training collective waits
    for a silent peer (what detects a node whose link is down: no FIN ever arrives)."""

    steps: int = 10
    global_batch: int = 12
    micro_batch: int = 2
    ckpt_every: int = 3
    kill_node: int = 2
    kill_step: int = 5
    seed: int = 0
    collective_timeout: float = 3.0
    async_save: bool = True  # AsyncSaver (stall: the snapshot) or SyncSaver (the whole write)
    ckpt_dir: str = ""
    events: str = ""  # JSON lines, one per event, from every rank and the controller


def schedule(global_batch: int, micro_batch: int, dp: int) -> int:
    """Micro-batches each rank accumulates so that ``dp * micro_batch * a == global_batch``."""
    if global_batch % (dp * micro_batch):
        raise ValueError(
            f"global_batch={global_batch} is not dp={dp} x micro_batch={micro_batch} x an "
            f"integer accumulation: this dp cannot keep the global batch"
        )
    return global_batch // (dp * micro_batch)


def batch(cfg: NodeLossConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``G`` samples of ``step``: arithmetic sequences mod vocab (learnable), each with a
    random start and stride from ``(seed, step)``. Tokens and targets, (G, T) each."""
    g = torch.Generator().manual_seed(1_000_003 * cfg.seed + step)
    start = torch.randint(0, MODEL.vocab_size, (cfg.global_batch, 1), generator=g)
    stride = torch.randint(1, 4, (cfg.global_batch, 1), generator=g)
    seq = (start + stride * torch.arange(MODEL.block_size + 1)) % MODEL.vocab_size  # (G, T+1)
    return seq[:, :-1], seq[:, 1:]


def _model(cfg: NodeLossConfig) -> GPT:
    torch.manual_seed(cfg.seed)
    return GPT(MODEL)


def _rank_grad(model: GPT, cfg: NodeLossConfig, step: int, rank: int, dp: int,
               on_first: Any = None) -> torch.Tensor:  # fmt: skip
    """Rank ``rank``'s accumulated gradient of the global mean loss, and (last element) its
    loss sum: (P + 1,)."""
    x, y = batch(cfg, step)
    per_rank, b = cfg.global_batch // dp, cfg.micro_batch
    acc = torch.zeros(sum(p.numel() for p in model.parameters()) + 1)
    for j in range(schedule(cfg.global_batch, b, dp)):
        lo = rank * per_rank + j * b
        model.zero_grad(set_to_none=True)
        loss = lm_loss(model(x[lo : lo + b]), y[lo : lo + b])
        (loss * (b / cfg.global_batch)).backward()
        acc[:-1] += torch.cat(
            [p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]
        )
        acc[-1] += loss.item() * b
        if j == 0 and on_first is not None:
            on_first()
    return acc


def _adam_range(params: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                step: int, lo: int, hi: int) -> None:  # fmt: skip
    adamw_(params[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], step, ADAM)


class SyncSaver:
    """Save a checkpoint and return when it is committed (``save_checkpoint``): the loop
    stalls for the whole write. A saver has ``save(step, state)`` (returns the seconds of
    the write done in the background so far: 0 here) and ``wait()``."""

    def __init__(self, root: str, group: dist.ProcessGroup | None, keep: int) -> None:
        self.root, self.group, self.keep = root, group, keep

    def save(self, step: int, state: dict[str, Any]) -> float:
        save_checkpoint(self.root, step, state, keep=self.keep, group=self.group)
        return 0.0

    def wait(self) -> None:
        return None


class AsyncSaver(SyncSaver):
    """:class:`labkit.checkpoint.async_save.AsyncCheckpointer`: the loop stalls for the
    snapshot only; the write runs in the background, the next save waits for it, and the
    commit stays atomic (same on-disk format, read by ``load_checkpoint``)."""

    def __init__(self, root: str, group: dist.ProcessGroup | None, keep: int) -> None:
        from labkit.checkpoint.async_save import AsyncCheckpointer

        super().__init__(root, group, keep)
        self.writer = AsyncCheckpointer(root, keep=keep, group=group)
        self.last_write_s = 0.0

    def save(self, step: int, state: dict[str, Any]) -> float:
        self.wait()  # the previous write: its duration is what ran beside training
        self.writer.save(step, state)
        return self.last_write_s

    def wait(self) -> None:
        pending = self.writer.pending
        self.writer.wait()
        if pending is not None:
            self.last_write_s = pending.seconds


class _Log:
    """Append one JSON line per event to the shared events file (``O_APPEND``: whole lines)."""

    def __init__(self, path: str, **fields: Any) -> None:
        self.path, self.fields = path, fields

    def __call__(self, event: str, **extra: Any) -> None:
        line = json.dumps({"t": time.monotonic(), "event": event, **self.fields, **extra})
        with open_private(self.path, "a") as f:
            f.write(line + "\n")


def _resume(
    ckpt: Checkpoint, model: nn.Module, rank: int, dp: int
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Params (full, replicated) and this rank's ZeRO-1 moments, read from the old shards."""
    n = sum(p.numel() for p in model.parameters())
    ckpt.expect({"/params": (n,), "/exp_avg": (n,), "/exp_avg_sq": (n,)})  # this model's, 1:1
    params = ckpt.tensor("/params")  # (P,)
    lo, hi = shard_range(params.numel(), rank, dp)
    m, v = torch.zeros_like(params), torch.zeros_like(params)
    m[lo:hi], v[lo:hi] = ckpt.read_slice("/exp_avg", lo, hi), ckpt.read_slice("/exp_avg_sq", lo, hi)
    return int(ckpt.state()["step"]), params, m, v


def train(cfg: NodeLossConfig) -> None:
    """One rank (torch.distributed is initialised by torchrun's environment)."""
    rank, dp = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    node = int(os.environ.get("LABKIT_NODE", "0"))
    log = _Log(cfg.events, rank=rank, dp=dp, attempt=attempt, node=node)
    log("started")  # torch imported, the default group up: the rendezvous is behind us
    # A second group with a short timeout carries the training: a silent peer is detected in
    # collective_timeout s, while the default group's long timeout covered the start-up.
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.collective_timeout))
    model = _model(cfg)
    params = parameters_to_vector(model.parameters()).detach().clone()  # (P,)
    m, v = torch.zeros_like(params), torch.zeros_like(params)
    step = 0
    if latest_step(cfg.ckpt_dir) is not None:
        t0 = time.monotonic()
        ckpt = load_checkpoint(cfg.ckpt_dir)
        step, params, m, v = _resume(ckpt, model, rank, dp)
        vector_to_parameters(params, model.parameters())
        log("resumed", step=step, saved_dp=ckpt.world_size, load_s=time.monotonic() - t0)
    accumulation = schedule(cfg.global_batch, cfg.micro_batch, dp)
    log("schedule", step=step, micro_batch=cfg.micro_batch, accumulation=accumulation,
        global_batch=cfg.global_batch)  # fmt: skip
    kind = AsyncSaver if cfg.async_save else SyncSaver
    saver = kind(cfg.ckpt_dir, group, keep=cfg.steps // cfg.ckpt_every + 1)  # keep them all
    lo, hi = shard_range(params.numel(), rank, dp)
    doomed = attempt == 0 and node == cfg.kill_node

    def midstep() -> None:  # the doomed node's ranks stop mid-step; the drill kills them here
        if doomed and step == cfg.kill_step:
            log("midstep", step=step)
            time.sleep(120)

    try:
        while step < cfg.steps:
            log("step_start", step=step)
            acc = _rank_grad(model, cfg, step, rank, dp, midstep)
            dist.all_reduce(acc, group=group)  # (P + 1,): gradient sum and loss sum
            _adam_range(params, acc[:-1], m, v, step + 1, lo, hi)
            full = torch.zeros_like(params)
            full[lo:hi] = params[lo:hi]
            dist.all_reduce(full, group=group)  # every range from its owner
            params = full
            vector_to_parameters(params, model.parameters())
            step += 1
            log("step_end", step=step, loss=acc[-1].item() / cfg.global_batch)
            if step % cfg.ckpt_every == 0 and step < cfg.steps:
                t0 = time.monotonic()
                state = {"params": params, "exp_avg": m, "exp_avg_sq": v, "step": step}
                before = saver.save(step, state)  # returns the previous save's write time
                log("saved", step=step, save_s=time.monotonic() - t0, previous_write_s=before)
        saver.wait()
    except Exception as exc:
        log("error", step=step, error=f"{type(exc).__name__}: {exc}"[:400])
        raise
    if rank == 0:
        log("done", step=step, checksum=float(params.double().sum()))


def reference(cfg: NodeLossConfig, dp: int, ckpt: Checkpoint | None = None,
              global_batch: int | None = None) -> list[float]:  # fmt: skip
    """The losses of the steps after ``ckpt`` (all steps without it) in ONE process emulating
    ``dp`` ranks, their gradients summed in rank order. ``global_batch`` other than the
    config's is the wrong restart (dp shrank, the accumulation did not rise: a smaller batch)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each torchrun worker (OMP_NUM_THREADS=1): same kernels
    try:
        model = _model(cfg)
        params = parameters_to_vector(model.parameters()).detach().clone()
        m, v = torch.zeros_like(params), torch.zeros_like(params)
        start = 0
        if ckpt is not None:
            start, params, m, v = _resume(ckpt, model, 0, 1)  # one rank owns the whole range
            vector_to_parameters(params, model.parameters())
        run = replace(cfg, global_batch=global_batch or cfg.global_batch)
        losses = []
        for step in range(start, cfg.steps):
            parts = [_rank_grad(model, run, step, r, dp) for r in range(dp)]
            total = parts[0].clone()
            for p in parts[1:]:
                total += p
            _adam_range(params, total[:-1], m, v, step + 1, 0, params.numel())
            vector_to_parameters(params, model.parameters())
            losses.append(total[-1].item() / run.global_batch)
        return losses
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> None:
    from labkit.launch import run_from_env

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="NodeLossConfig as JSON")
    cfg = NodeLossConfig(**json.loads(parser.parse_args(argv).config))
    make_private_dir(cfg.ckpt_dir, 0o755, parents=True, exist_ok=True)  # every node makes it
    run_from_env(train, cfg, backend="gloo", timeout=60.0)


if __name__ == "__main__":
    main()
