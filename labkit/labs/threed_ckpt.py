"""Lab 08's 3D miniature with logical checkpoints: stop under one layout, go on under another.

:func:`train` is :func:`labkit.labs.threed.train` plus a dynamic loss scaler, a save after step
``save_at`` (:func:`threed_state`: the model, the ZeRO-1 or DDP optimizer shards, the tied
embedding once, the scaler, every rank's RNG) and a resume from the newest checkpoint under
``root`` (:func:`restore_threed`), whatever dp x tp x pp (and ZeRO partition, and pipeline
cut) wrote it. The global batch of a step is ``dp * micro_batches * micro_batch`` sequences
drawn from (seed, step) alone, so two layouts with equal ``dp * micro_batches`` train on the
same data and a resumed run must equal the uninterrupted single-process one
(:func:`labkit.labs.threed.reference`, tests/test_checkpoint_layouts.py).

The loss scaler runs on fp32 with a power-of-two scale: scaling the loss by ``S = 2^k`` and
unscaling the gradients by ``1/S`` is exact, so the scaler changes no bit of the training and
its state (scale, growth streak) is what the checkpoint must carry across layouts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from labkit.checkpoint import (
    AsyncCheckpointer,
    CheckpointError,
    LogicalCheckpoint,
    LogicalState,
    check_split,
    load_logical,
    save_logical,
)
from labkit.checkpoint.zero_state import ShardInfo, check_model, collect, restore
from labkit.labs.threed import LabConfig, batch, build_model, checksum
from labkit.models.gpt import GPT, GPTConfig
from labkit.parallel.threed import ThreeD, build_threed
from labkit.pipeline.executor import pipeline_step
from labkit.precision import DynamicLossScaler
from labkit.tensor_parallel import vocab_parallel_cross_entropy

__all__ = ["check_checkpoint", "model_shapes", "restore_threed", "shard_info", "threed_state",
           "train"]  # fmt: skip

TIED = {"head.weight": "wte.weight"}  # the head's copy of the tied embedding (a later stage)


def _layout(job: ThreeD) -> dict[str, Any]:
    """The saving layout as JSON will return it (a cut is a list there, not a tuple: compared
    as a tuple, a same-layout resume with a cut would never get its RNG back)."""
    c = job.cfg
    cut = None if c.stage_layers is None else list(c.stage_layers)
    return {"dp": c.degrees.dp, "tp": c.degrees.tp, "pp": c.degrees.pp, "zero": c.zero,
            "virtual": c.virtual, "stage_layers": cut}  # fmt: skip


def model_shapes(model_cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the whole model and its shape (a tied head is not listed twice):
    built on the meta device, so it costs no memory."""
    with torch.device("meta"):
        model = GPT(model_cfg)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def shard_info(job: ThreeD) -> ShardInfo:
    lay = job.layout
    aliases = TIED if job.model_cfg.tie_weights else {}
    return ShardInfo(lay.tp_rank, job.cfg.degrees.tp, lay.dp_rank, aliases)


def threed_state(job: ThreeD, scaler: DynamicLossScaler | None) -> LogicalState:
    """This rank's owned chunks of the 3D run, the scaler and its RNG streams."""
    state = collect(job.named_parameters(), job.optimizer, shard_info(job))
    if scaler is not None:
        state.objects["scaler"] = scaler.state_dict()
    state.rank_state = {"torch_rng": torch.get_rng_state()}
    state.layout = _layout(job)
    return state


def restore_threed(job: ThreeD, ckpt: LogicalCheckpoint, scaler: DynamicLossScaler | None,
                   load_optimizer: bool = True) -> bool:  # fmt: skip
    """Load ``ckpt`` into this rank's shards; restore the RNG when the layout is the saving
    one. Returns whether it was (per-rank streams do not reshard)."""
    info = shard_info(job)
    restore(ckpt, job.named_parameters(), job.optimizer, info, model=model_shapes(job.model_cfg),
            load_optimizer=load_optimizer)  # fmt: skip
    if scaler is not None and "scaler" in ckpt.objects:  # (a DCP import has none)
        scaler.load_state_dict(ckpt.objects["scaler"])
    mine = ckpt.rank_state(dist.get_rank(), _layout(job))
    if mine is not None:
        torch.set_rng_state(mine["torch_rng"])
    return mine is not None


def check_checkpoint(cfg: LabConfig, ckpt: LogicalCheckpoint) -> None:
    """Before any process starts: the checkpoint holds this model (every parameter, at its
    shape) and the new layout can hold it (every tensor-parallel cut divides), or a
    ``CheckpointError``/``ValueError`` naming the tensor and the two shapes."""
    shapes = model_shapes(cfg.model)
    for name, shape in shapes.items():
        if name not in TIED or not cfg.model.tie_weights:
            ckpt.entry(f"model/{name}", shape)
    expected = {f"model/{n}" for n in shapes}
    extra = sorted(k for k in ckpt.tensors if k.startswith("model/") and k not in expected)
    if extra:
        raise CheckpointError(f"checkpoint {ckpt.path} holds tensors this model lacks: {extra}")
    check_model(ckpt, shapes, TIED if cfg.model.tie_weights else {})
    for key, entry in ckpt.tensors.items():
        check_split(key, entry["shape"], entry["tp_dim"], cfg.threed.degrees.tp)


def _step(job: ThreeD, scaler: DynamicLossScaler, x: list[torch.Tensor],
          y: list[torch.Tensor]) -> float | None:  # fmt: skip
    """:meth:`ThreeD.step` with the loss scaled (the optimizer unscales and may skip)."""
    job.optimizer.zero_grad()
    scale = scaler.get_scale()

    def loss_fn(logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return scaler.scale(vocab_parallel_cross_entropy(logits, tgt, job.loss_comm))

    shape = (job.cfg.micro_batch, x[0].shape[1], job.model_cfg.n_embd)  # (b, T, d)
    res = pipeline_step(job.sched, job.chunks, x, y, shape, group=job.layout.pp_group,
                        loss_fn=loss_fn, barrier=False)  # fmt: skip
    job.reduce_tied()
    job.optimizer.step()
    return None if res.loss is None else res.loss / scale


def train(cfg: LabConfig, root: str, save_at: int | None = None, resume: bool = False,
          background: bool = False, load_optimizer: bool = True) -> dict[str, Any]:  # fmt: skip
    """On every rank: train until ``cfg.steps`` (from the newest checkpoint under ``root``
    when ``resume``; ``load_optimizer=False``: fresh Adam moments, a negative control),
    saving after step ``save_at`` (in the background when asked). Returns
    the losses of the steps run, this stage's full parameters (tp rank 0 of replica 0), the
    scaler's state, the step resumed from and whether the RNG was restored."""
    t = cfg.threed
    job = build_threed(build_model(cfg), t, cfg.adam)
    scaler = DynamicLossScaler(init_scale=16.0, growth_interval=2)  # agrees over the world
    job.optimizer.scaler = scaler
    start, rng_restored = 0, False
    if resume:
        ckpt = load_logical(root)
        check_checkpoint(cfg, ckpt)  # the same model, one to one, and this layout can hold it
        rng_restored, start = restore_threed(job, ckpt, scaler, load_optimizer), ckpt.step
    saver = AsyncCheckpointer(root, background=background)
    d, m = job.dp_rank, t.micro_batches
    losses = []
    for step in range(start, cfg.steps):
        x, y = batch(cfg, step)  # (dp * m, b, T) each
        loss = _step(job, scaler, list(x[d * m : (d + 1) * m]), list(y[d * m : (d + 1) * m]))
        if loss is not None:  # the dp replicas' mean
            mean = torch.tensor([loss])
            dist.all_reduce(mean, group=job.layout.dp_group)
            loss = mean.item() / t.degrees.dp
        losses.append(loss)
        if save_at == step + 1:
            if background:
                saver.save_logical(step + 1, threed_state(job, scaler))
            else:
                save_logical(root, step + 1, threed_state(job, scaler))
    saver.finish()
    full = job.gather_full()
    keep = job.layout.tp_rank == 0 and d == 0
    params = {n: v.cpu() for n, v in full.items()} if keep else {}
    total = torch.tensor([checksum(params) if keep else 0.0], dtype=torch.float64)
    dist.all_reduce(total)
    job.close()
    return {"rank": dist.get_rank(), "losses": losses, "params": params, "start": start,
            "scaler": scaler.state_dict(), "rng_restored": rng_restored,
            "checksum": float(total.item())}  # fmt: skip
