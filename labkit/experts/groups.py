"""Which ranks an expert-parallel job groups together, and which group reduces which gradient.

Expert parallelism subdivides the data-parallel ranks (it does not multiply the world): of
``dp`` data-parallel ranks, ``ep`` consecutive ones form an *ep group* that holds the ``E``
experts between them, ``E / ep`` each, and exchanges tokens by all-to-all; the ``dp / ep``
ranks that hold the *same* experts form an *expert-dp group*. With Megatron's order (tp
innermost, then dp, pp outermost; :mod:`labkit.parallel.layout`)::

    global rank = pp_idx * dp * tp + dp_idx * tp + tp_idx,   dp_idx = j * ep + e
    ep group        {e = 0..ep-1}       at fixed (pp_idx, j, tp_idx)
    expert-dp group {j = 0..dp/ep-1}    at fixed (pp_idx, e, tp_idx)

Gradients. The objective is the mean of the ``dp`` ranks' losses, so every gradient is
``1/dp`` times a sum over data-parallel ranks. A non-expert parameter (attention, router,
shared expert) is replicated on all ``dp`` ranks: all-reduce SUM over the dp group, divide by
``dp`` (DDP, as before). An expert's gradient on the rank holding it already sums what every
rank of its ep group sent it (the all-to-all's backward carries it), so it needs only the sum
over the ``dp / ep`` replicas, still divided by ``dp``: SUM over the expert-dp group, then
``/ dp``. Averaging over the expert-dp group instead (``/ (dp/ep)``) is ``ep`` times too big;
reducing over the dp group adds other experts' gradients. Both are rejected in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from labkit.experts.layer import Experts

__all__ = [
    "ExpertGroups",
    "build_expert_groups",
    "expert_parameters",
    "expert_rank_groups",
    "reduce_moe_gradients",
]


def expert_rank_groups(dp: int, ep: int, tp: int = 1, pp: int = 1) -> dict[str, list[list[int]]]:
    """The global ranks of every ep, expert-dp, dp and tp group (module docstring); pure."""
    for name, v in (("dp", dp), ("ep", ep), ("tp", tp), ("pp", pp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be an integer >= 1 (dp={dp}, ep={ep}, tp={tp})")
    if dp % ep:
        raise ValueError(
            f"ep={ep} must divide dp={dp}: expert parallelism splits the data-parallel ranks "
            f"into groups of ep that share the experts"
        )

    def rank(s: int, d: int, t: int) -> int:
        return s * dp * tp + d * tp + t

    groups: dict[str, list[list[int]]] = {"ep": [], "expert_dp": [], "dp": [], "tp": []}
    for s in range(pp):
        for t in range(tp):
            groups["dp"].append([rank(s, d, t) for d in range(dp)])
            for j in range(dp // ep):
                groups["ep"].append([rank(s, j * ep + e, t) for e in range(ep)])
            for e in range(ep):
                groups["expert_dp"].append([rank(s, j * ep + e, t) for j in range(dp // ep)])
        for d in range(dp):
            groups["tp"].append([rank(s, d, t) for t in range(tp)])
    return groups


@dataclass
class ExpertGroups:
    """This rank's groups and coordinates: ``ep_rank`` (which expert slice it holds),
    ``dp_rank`` (which data shard it reads), ``tp_rank``; the sizes ``dp``, ``ep``, ``tp``."""

    ep: ProcessGroup
    expert_dp: ProcessGroup
    dp: ProcessGroup
    tp: ProcessGroup
    ep_size: int
    dp_size: int
    tp_size: int
    ep_rank: int
    dp_rank: int
    tp_rank: int

    @classmethod
    def from_layout(cls, layout: Any) -> ExpertGroups:
        """This rank's groups from a :class:`labkit.parallel.layout.Layout` built with ``ep``:
        its ``ep_group`` and ``edp_group`` (the same ranks as :func:`expert_rank_groups`);
        dense gradients over its ``dp_cp_group`` (``dp_group`` when ``cp == 1``), both kinds
        divided by ``dp * cp``, the ranks whose tokens the loss averages."""
        deg = layout.degrees
        dense = layout.dp_cp_group if layout.dp_cp_group is not None else layout.dp_group
        if layout.ep_group is None or layout.edp_group is None:
            raise ValueError(f"the layout has no expert groups (degrees {deg})")
        return cls(
            layout.ep_group, layout.edp_group, dense, layout.tp_group, deg.ep,
            deg.dp * deg.cp, deg.tp, ep_rank=layout.ep_rank,
            dp_rank=dist.get_rank(dense), tp_rank=layout.tp_rank,
        )  # fmt: skip


def build_expert_groups(dp: int, ep: int, tp: int = 1) -> ExpertGroups:
    """Create every group (each rank calls ``new_group`` for all of them, in one order, as
    torch requires) and return this rank's. ``dp * tp`` must be the world size."""
    ranks = expert_rank_groups(dp, ep, tp)
    world = dist.get_world_size()
    if dp * tp != world:
        raise ValueError(f"dp={dp} x tp={tp} = {dp * tp} ranks, but world_size={world}")
    me = dist.get_rank()
    mine: dict[str, ProcessGroup] = {}
    for kind, lists in ranks.items():
        for members in lists:
            group = dist.new_group(members)
            if me in members:
                mine[kind] = group
    return ExpertGroups(
        mine["ep"], mine["expert_dp"], mine["dp"], mine["tp"], ep, dp, tp,
        ep_rank=(me // tp) % ep, dp_rank=me // tp, tp_rank=me % tp,
    )  # fmt: skip


def expert_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters that live in an :class:`Experts` (each rank's own slice)."""
    return {id(p) for m in model.modules() if isinstance(m, Experts) for p in m.parameters()}


def _reduce(params: list[nn.Parameter], group: ProcessGroup, divisor: int) -> None:
    """SUM the grads over ``group`` in one flat buffer, then divide by ``divisor``."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])  # one message, not one per tensor
    dist.all_reduce(flat, group=group)
    flat /= divisor
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def reduce_moe_gradients(
    model: nn.Module, groups: ExpertGroups, *, expert_group: ProcessGroup | None = None
) -> None:
    """After backward: non-expert grads SUM over dp / dp; expert grads SUM over expert-dp / dp.

    ``expert_group`` overrides the experts' group (the tests pass a wrong one to prove it is
    caught). Every rank holds a gradient for every parameter it owns (zeros if no token
    reached it: ``Experts`` is used by every call), so the collectives always match.
    """
    experts = expert_parameters(model)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:  # an expert no token reached still joins the reduction, with zeros
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    _reduce([p for p in params if id(p) not in experts], groups.dp, groups.dp_size)
    _reduce(
        [p for p in params if id(p) in experts], expert_group or groups.expert_dp, groups.dp_size
    )
