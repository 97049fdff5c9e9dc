"""Parallel degrees in one validated dataclass, and the process groups built from them.

Megatron-LM's rank ordering (Narayanan et al. 2021, section 3.3; Megatron's default
"tp-dp-pp" order): tensor-parallel ranks are *adjacent* (global ranks ``r, r+1, ...``), so a
tp group sits inside one node on its fast links; pipeline stages are the *outermost* index, so
consecutive stages usually sit on different nodes, where only point-to-point activations cross
the slow links. As a formula, for ``(pp_idx, dp_idx, tp_idx)``::

    global_rank = pp_idx * (dp * tp) + dp_idx * tp + tp_idx

which is exactly a ``DeviceMesh`` of shape ``(pp, dp, tp)`` over ``arange(world_size)``.
:func:`rank_grid` computes it without processes (a 64-rank layout is tested that way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "Layout",
    "ParallelDegrees",
    "build_layout",
    "global_rank",
    "group_rank_and_size",
    "rank_grid",
]

MESH_DIMS = ("pp", "dp", "tp")  # outermost to innermost


@dataclass(frozen=True)
class ParallelDegrees:
    """How many ways each axis splits the job: data (dp), tensor (tp) and pipeline (pp).

    ``world_size`` is their product. Validation happens here, before any process starts.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(
                    f"parallel degree {name}={v!r} must be an integer >= 1 "
                    f"(dp={self.dp}, tp={self.tp}, pp={self.pp})"
                )

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def check_world_size(self, world_size: int) -> None:
        """Raise unless dp * tp * pp == world_size, naming every degree."""
        if self.world_size != world_size:
            raise ValueError(
                f"dp={self.dp} x tp={self.tp} x pp={self.pp} = {self.world_size} ranks, "
                f"but world_size={world_size}: the product of the degrees must equal the world size"
            )

    def check_model(
        self, *, hidden: int, heads: int, vocab: int | None = None, layers: int | None = None
    ) -> None:
        """Raise unless the model's shape splits: hidden and heads (and the vocabulary, for a
        vocab-parallel embedding) evenly by tp, and at least a layer per pipeline stage (a
        count pp does not divide is cut unevenly, ``labkit.pipeline.cut``). Names both."""
        if hidden % self.tp:
            raise ValueError(f"hidden size {hidden} is not divisible by tp={self.tp}")
        if heads % self.tp:
            raise ValueError(f"head count {heads} is not divisible by tp={self.tp}")
        if vocab is not None and vocab % self.tp:
            raise ValueError(
                f"vocabulary {vocab} is not divisible by tp={self.tp} "
                f"(pad it, e.g. to {-(-vocab // self.tp) * self.tp})"
            )
        if layers is not None and layers < self.pp:
            raise ValueError(f"{layers} layers cannot fill pp={self.pp} pipeline stages")


def rank_grid(degrees: ParallelDegrees, order: str = "tp-dp-pp") -> dict[str, list[list[int]]]:
    """The global ranks of every tp, dp and pp group, computed without processes.

    ``{"tp": [[0, 1], [2, 3], ...], "dp": [...], "pp": [...]}``: each inner list is one group,
    its ranks in group-rank order. ``order`` names the axes innermost first: Megatron's
    ``"tp-dp-pp"`` (the default, what :func:`build_layout` builds) numbers ranks
    ``pp_idx * (dp tp) + dp_idx * tp + tp_idx``; another order, e.g. ``"dp-tp-pp"``
    (``pp_idx * (tp dp) + tp_idx * dp + dp_idx``), is a placement the planner can price.
    """
    axes = order.split("-")
    if sorted(axes) != sorted(MESH_DIMS):
        raise ValueError(
            f"rank order {order!r} must name each of {MESH_DIMS} once, innermost first"
        )
    size = {"pp": degrees.pp, "dp": degrees.dp, "tp": degrees.tp}
    outer_first = axes[::-1]
    grid = torch.arange(degrees.world_size).reshape([size[a] for a in outer_first])
    grid = grid.permute([outer_first.index(a) for a in MESH_DIMS])  # -> (pp, dp, tp)
    shape = tuple(grid.shape)
    groups: dict[str, list[list[int]]] = {}
    for axis, name in enumerate(MESH_DIMS):
        moved = grid.movedim(axis, -1).reshape(-1, shape[axis])  # one row per group along `name`
        groups[name] = [row.tolist() for row in moved]
    return groups


@dataclass
class Layout:
    """The process groups of one job. Pass ``layout.tp_group`` etc. to each technique."""

    degrees: ParallelDegrees
    mesh: Any  # torch.distributed.device_mesh.DeviceMesh of shape (pp, dp, tp)
    tp_group: ProcessGroup
    dp_group: ProcessGroup
    pp_group: ProcessGroup

    @property
    def tp_rank(self) -> int:
        return dist.get_rank(self.tp_group)

    @property
    def dp_rank(self) -> int:
        return dist.get_rank(self.dp_group)

    @property
    def pp_rank(self) -> int:
        return dist.get_rank(self.pp_group)


def build_layout(degrees: ParallelDegrees, device_type: str | None = None) -> Layout:
    """Build the (pp, dp, tp) ``DeviceMesh`` and its groups. Call on every rank, after
    ``init_process_group``; ``device_type`` defaults to "cuda" on NCCL and "cpu" otherwise."""
    from torch.distributed.device_mesh import init_device_mesh

    degrees.check_world_size(dist.get_world_size())
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(
        device_type, (degrees.pp, degrees.dp, degrees.tp), mesh_dim_names=MESH_DIMS
    )
    return Layout(
        degrees=degrees,
        mesh=mesh,
        tp_group=mesh.get_group("tp"),
        dp_group=mesh.get_group("dp"),
        pp_group=mesh.get_group("pp"),
    )


def group_rank_and_size(group: ProcessGroup | None) -> tuple[int, int]:
    """This process's rank inside ``group`` (None = WORLD) and the group's size."""
    return dist.get_rank(group), dist.get_world_size(group)


def global_rank(group: ProcessGroup | None, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (None = WORLD): what point-to-point calls
    and ``broadcast(src=...)`` need, even on a subgroup. The one home of this logic."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)
