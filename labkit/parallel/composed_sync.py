"""The composition matrix's per-step synchronisation pieces beside the dp wrapper (split from
:mod:`labkit.parallel.composed` by job): sequence-parallel gradients summed over tp, the loss
averaged over dp x cp, and each step's full-size parameters for the comparison."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from labkit.collectives import Comm
from labkit.parallel.composed_ref import norm_name
from labkit.parallel.cp_ep import expert_full_size
from labkit.parallel.matrix import Combo
from labkit.parallel.threed import full_size

__all__ = ["dp_mean", "snapshot", "sum_sequence_parallel"]


def sum_sequence_parallel(stages: Any, opt: Any, comm: Comm, sharded: bool) -> None:
    """Sum the partial gradients of sequence-parallel parameters over tp (one flat all-reduce):
    ``p.grad`` where it lives, or ZeRO-2/3's gradient shard pieces of those parameters."""
    views = []
    if sharded:
        for u in opt.units:
            for pc in opt.pieces[u]:
                if getattr(u.params[pc.param], "sequence_parallel", False):
                    views.append(u.grad[pc.shard_start : pc.shard_start + pc.length])
    else:
        views = [
            p.grad for p in stages.parameters()
            if getattr(p, "sequence_parallel", False) and p.grad is not None
        ]  # fmt: skip
    if not views:
        return
    flat = torch.cat([v.reshape(-1) for v in views])
    comm.all_reduce(flat)
    offset = 0
    for v in views:
        v.copy_(flat[offset : offset + v.numel()].view_as(v))
        offset += v.numel()


def dp_mean(loss: float | None, layout: Any) -> float | None:
    if loss is None:
        return None
    t = torch.tensor([loss], dtype=torch.float64)
    group = layout.dp_cp_group  # every rank whose tokens the loss averages
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


def snapshot(combo: Combo, stages: Any, model: Any, opt: Any, layout: Any) -> dict[str, Any]:
    """This stage's full parameters (tp shards all-gathered) on tp rank 0 of every replica, so
    the replicas are each compared (ZeRO-3: replica 0's consolidation of the shards, a
    collective over dp)."""
    values = {id(p): p.detach() for p in stages.parameters()}
    if combo.dp.startswith("zero3"):
        sd = opt.full_state_dict()  # every dp rank calls it; rank 0 of dp gets it
        if sd is None:
            return {}
        named = dict(model.named_parameters())
        values.update({id(named[n]): t for n, t in sd["params"].items()})  # full shape
    out = {  # tp shards gathered, then expert shards over ep (every rank takes part)
        norm_name(name.split(".", 2)[2], combo.tied): expert_full_size(
            p, full_size(p, values[id(p)], layout.tp_group), layout.ep_group
        ).clone()
        for name, p in stages.named_parameters()
    }
    return out if layout.tp_rank == 0 else {}
