"""A rank's model and ZeRO optimizer state as logical chunks, and back under any layout.

What this rank holds (``named``: its parameters, each a tensor-parallel shard when it
carries ``tp_shard_dim``, named as in the unsharded model; ``optimizer``: a
:class:`labkit.zero.ShardedAdamW` over the data-parallel group) becomes chunks of logical
tensors, each written by exactly one rank:

* ``model/NAME``: the parameter. ZeRO (stages 1-3): each dp rank writes its fp32 master
  range, cut into its parameter pieces (``Piece``: ``[param_start, + length)`` of the flat
  tensor-parallel shard) -- the writes are spread over dp like the state. DDP: dp rank 0
  writes the whole shard. Frozen parameters (no optimizer): dp rank 0, the whole shard.
* ``optim/exp_avg/NAME``, ``optim/exp_avg_sq/NAME``: Adam's moments, the same pieces.
* objects ``optim/steps/NAME`` (Adam's per-parameter step count) and ``optim/step_count``.

Tensor parallelism: a parameter cut along ``tp_shard_dim`` is written by every tp rank (its
box, :func:`~labkit.checkpoint.reshard.tp_place`); a replicated one by tp rank 0 only.
``aliases`` (``{"head.weight": "wte.weight"}``: a tied copy held by another stage) are read
from their canonical tensor and never written: the tied pair's two copies are equal (the
same summed gradient, the same Adam steps), so the checkpoint holds one.

Loading (:func:`restore`) reads, for every parameter of the *new* layout, its box, and for
every ZeRO piece of the new dp partition its range: the metadata says which saved chunks
cover it (:func:`~labkit.checkpoint.reshard.plan_read`), so tp, pp, dp and the ZeRO partition
may all differ from the saving run's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from labkit.checkpoint.layout import CheckpointError
from labkit.checkpoint.logical import LogicalCheckpoint, LogicalState
from labkit.checkpoint.match import check_one_to_one
from labkit.checkpoint.reshard import Place, tp_place
from labkit.zero.partition import Piece, Unit
from labkit.zero.sharded import ShardedAdamW
from labkit.zero.stage0 import DDPAdam

__all__ = ["ShardInfo", "check_model", "collect", "global_shape", "restore"]

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class ShardInfo:
    """This rank's coordinates: tensor-parallel rank and size, data-parallel rank, aliases."""

    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    aliases: dict[str, str] = field(default_factory=dict)


def global_shape(p: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    """The full tensor's shape: the local shard's, times ``tp_size`` along ``tp_shard_dim``."""
    dim = getattr(p, "tp_shard_dim", None)
    return tuple(s * tp_size if d == dim else s for d, s in enumerate(p.shape))


def _box(p: torch.Tensor, info: ShardInfo) -> tuple[Place, int | None]:
    dim = getattr(p, "tp_shard_dim", None)
    return tp_place(global_shape(p, info.tp_size), dim, info.tp_rank, info.tp_size), dim


def _piece_place(box: Place, pc: Piece) -> Place:
    """The place of ZeRO piece ``pc``: its flat range of the tensor-parallel box."""
    return Place(box.shape, box.offsets, box.sizes, (pc.param_start, pc.param_start + pc.length))


def _pieces(opt: ShardedAdamW) -> list[tuple[Unit, Piece]]:
    return [(u, pc) for u in opt.units for pc in opt.pieces[u]]


def collect(
    named: list[tuple[str, nn.Parameter]],
    optimizer: ShardedAdamW | None,
    info: ShardInfo,
    state: LogicalState | None = None,
) -> LogicalState:
    """This rank's owned chunks (see the module docstring), added to ``state``."""
    state = state or LogicalState()
    name_of = {id(p): n for n, p in named}
    managed = {id(p) for p in optimizer.managed()} if optimizer is not None else set()
    sharded = optimizer is not None and not isinstance(optimizer, DDPAdam)
    if optimizer is not None:
        state.objects["optim/step_count"] = optimizer.step_count
        for u, pc in _pieces(optimizer):
            p = u.params[pc.param]
            name = name_of[id(p)]
            box, dim = _box(p, info)
            replica = name in info.aliases or (dim is None and info.tp_rank != 0)
            if replica or not (sharded or info.dp_rank == 0):
                continue
            state.objects[f"optim/steps/{name}"] = u.steps[pc.param]
            place = _piece_place(box, pc)
            mine = slice(pc.shard_start, pc.shard_start + pc.length)
            state.add(f"model/{name}", u.master[mine], place, dim)
            for m in MOMENTS:
                state.add(f"optim/{m}/{name}", getattr(u, m)[mine], place, dim)
    for name, p in named:
        box, dim = _box(p, info)
        if id(p) in managed or name in info.aliases or (dim is None and info.tp_rank != 0):
            continue
        if info.dp_rank == 0:  # frozen or optimizer-less: dp rank 0 writes the whole shard
            state.add(f"model/{name}", p.detach(), box, dim)
    return state


def check_model(
    ckpt: LogicalCheckpoint, model: Mapping[str, tuple[int, ...]], aliases: Mapping[str, str]
) -> None:
    """The checkpoint's ``model/*`` tensors are ``model``'s parameters (less ``aliases``) one to
    one, at the same shapes, and its optimizer moments are of those parameters only."""
    want = {f"model/{n}": tuple(s) for n, s in model.items() if n not in aliases}
    saved = {k: tuple(e["shape"]) for k, e in ckpt.tensors.items() if k.startswith("model/")}
    check_one_to_one(ckpt.path, saved, want)
    for key, e in ckpt.tensors.items():
        param = f"model/{key.split('/', 2)[-1]}"  # optim/exp_avg/NAME -> model/NAME
        if key.startswith("optim/") and want.get(param) != tuple(e["shape"]):
            raise CheckpointError(f"checkpoint {ckpt.path} does not match the model: tensor "
                                  f"{key!r} {tuple(e['shape'])} is not the state of a "
                                  f"parameter of the model")  # fmt: skip


@torch.no_grad()
def restore(
    ckpt: LogicalCheckpoint,
    named: list[tuple[str, nn.Parameter]],
    optimizer: ShardedAdamW | None,
    info: ShardInfo,
    *,
    model: Mapping[str, tuple[int, ...]],
    load_optimizer: bool = True,
) -> None:
    """Fill this rank's parameters (and optimizer state) from ``ckpt``, whatever layout
    wrote it. ``model``: every parameter of the whole (unsharded) model and its shape -- a
    rank holds one pipeline stage, so only the whole model can tell that the checkpoint holds
    exactly its tensors, one to one (:func:`check_one_to_one`; tied copies in
    ``info.aliases`` are stored once). Refuses the first tensor that differs, naming it."""
    check_model(ckpt, model, info.aliases)
    name_of = {id(p): n for n, p in named}
    for name, p in named:
        box, _ = _box(p, info)
        key = f"model/{info.aliases.get(name, name)}"
        p.data.copy_(ckpt.read(key, box).view(p.shape))  # (numel,) -> the local shard shape
    if optimizer is None:
        return
    keeps_master = optimizer.policy.keeps_master
    for u, pc in _pieces(optimizer):
        p = u.params[pc.param]
        name = info.aliases.get(name_of[id(p)], name_of[id(p)])
        box, _ = _box(p, info)
        place = _piece_place(box, pc)
        mine = slice(pc.shard_start, pc.shard_start + pc.length)
        if keeps_master:  # a 16-bit run: the fp32 master range too, not the rounded copy
            u.master[mine] = ckpt.read(f"model/{name}", place, torch.float32)
        if load_optimizer:
            for m in MOMENTS:
                getattr(u, m)[mine] = ckpt.read(f"optim/{m}/{name}", place, torch.float32)
    if not load_optimizer:
        return
    for u in optimizer.units:
        for i, p in enumerate(u.params):
            name = info.aliases.get(name_of[id(p)], name_of[id(p)])
            key = f"optim/steps/{name}"
            if key not in ckpt.objects:
                raise ValueError(f"optimizer step count {key!r} is not in checkpoint {ckpt.path}")
            u.steps[i] = int(ckpt.objects[key])
    optimizer.step_count = int(ckpt.objects["optim/step_count"])
