"""Parallel degrees in one validated dataclass, and the process groups built from them.

Megatron-LM's rank ordering (Narayanan et al. 2021, section 3.3; Megatron-core's default
"tp-cp-ep-dp-pp" order): tensor-parallel ranks are *adjacent* (global ranks ``r, r+1, ...``),
so a tp group sits inside one node on its fast links; context-parallel ranks come next (a cp
ring passes K/V blocks every attention layer, so it wants the next-fastest links); pipeline
stages are the *outermost* index, so consecutive stages usually sit on different nodes, where
only point-to-point activations cross the slow links. As a formula, for
``(pp_idx, dp_idx, cp_idx, tp_idx)``::

    global_rank = pp_idx * (dp * cp * tp) + dp_idx * (cp * tp) + cp_idx * tp + tp_idx

which is exactly a ``DeviceMesh`` of shape ``(pp, dp, cp, tp)`` over ``arange(world_size)``;
with ``cp = 1`` it is the classic ``(pp, dp, tp)`` numbering, rank for rank.
:func:`rank_grid` computes it without processes (a 64-rank layout is tested that way).

Expert parallelism does not multiply the world: ``ep`` *subdivides* the ``dp x cp`` ranks of
one (pp, tp) position (Megatron-core's expert rank generator "tp-ep-dp-pp"). Number those
ranks ``k = dp_idx * cp + cp_idx``; then ``k = edp_idx * ep + ep_idx``: an ``ep`` group is
``ep`` consecutive ``k`` (experts are sharded over it, tokens cross it by all-to-all), and the
``edp`` ("expert data parallel") group is the ``dp*cp/ep`` ranks holding the same experts
(their gradients are averaged over it). Dense parameters see every token of ``dp x cp``
ranks, so with ``cp > 1`` their gradients are averaged over the ``dp_cp`` group, not ``dp``.
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

MESH_DIMS = ("pp", "dp", "cp", "tp")  # outermost to innermost
_DEGREES = ("dp", "tp", "pp", "cp", "ep")


@dataclass(frozen=True)
class ParallelDegrees:
    """How many ways each axis splits the job: data (dp), tensor (tp), pipeline (pp),
    context (cp: the sequence of every attention layer) and expert (ep).

    ``world_size = dp * tp * pp * cp``; ``ep`` carves expert groups out of the ``dp x cp``
    ranks (module docstring), so it must divide ``dp * cp`` and does not multiply the world.
    Validation happens here, before any process starts.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in _DEGREES:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(
                    f"parallel degree {name}={v!r} must be an integer >= 1 ({self._named()})"
                )
        if (self.dp * self.cp) % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide dp x cp = {self.dp} x {self.cp} = {self.dp * self.cp}: "
                f"expert groups are carved out of the data- and context-parallel ranks"
            )

    def _named(self) -> str:
        return ", ".join(f"{n}={getattr(self, n)!r}" for n in _DEGREES)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def check_world_size(self, world_size: int) -> None:
        """Raise unless dp * tp * pp * cp == world_size, naming every degree."""
        if self.world_size != world_size:
            cp = f" x cp={self.cp}" if self.cp > 1 else ""
            raise ValueError(
                f"dp={self.dp} x tp={self.tp} x pp={self.pp}{cp} = {self.world_size} ranks, "
                f"but world_size={world_size}: the product of the degrees must equal the world size"
            )

    def check_model(
        self,
        *,
        hidden: int,
        heads: int,
        vocab: int | None = None,
        layers: int | None = None,
        seq: int | None = None,
    ) -> None:
        """Raise unless the model's shape splits: hidden and heads (and the vocabulary, for a
        vocab-parallel embedding) evenly by tp, at least a layer per pipeline stage (a
        count pp does not divide is cut unevenly, ``labkit.pipeline.cut``), and the sequence
        into ``2 * cp`` chunks (the zigzag split of causal context parallelism). Names both."""
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
        if seq is not None and self.cp > 1 and seq % (2 * self.cp):
            raise ValueError(
                f"sequence length {seq} is not divisible by 2 x cp = {2 * self.cp} "
                f"(the zigzag split gives every cp rank two equal chunks)"
            )


def _axes(order: str) -> list[str]:
    """``order``'s axes innermost first, with ``cp`` placed right outside ``tp`` when the
    order does not name it (Megatron-core's "tp-cp-..." placement)."""
    axes = order.split("-")
    if "cp" not in axes and "tp" in axes:
        axes.insert(axes.index("tp") + 1, "cp")
    if sorted(axes) != sorted(MESH_DIMS):
        three = tuple(d for d in MESH_DIMS if d != "cp")
        raise ValueError(
            f"rank order {order!r} must name each of {three} once (and cp at most once), "
            f"innermost first"
        )
    return axes


def rank_grid(degrees: ParallelDegrees, order: str = "tp-dp-pp") -> dict[str, list[list[int]]]:
    """The global ranks of every tp, dp and pp group (and cp, ep, edp, dp_cp), computed
    without processes.

    ``{"tp": [[0, 1], [2, 3], ...], "dp": [...], "pp": [...]}``: each inner list is one group,
    its ranks in group-rank order. ``"cp"`` and ``"dp_cp"`` (the ranks a dense gradient is
    averaged over) appear when ``cp > 1``, ``"ep"`` and ``"edp"`` when ``ep > 1``; a degree
    of 1 adds only singleton groups, so the classic three keys are all a 3D layout has.
    ``order`` names the axes innermost first: Megatron's ``"tp-dp-pp"`` (the default, what
    :func:`build_layout` builds) numbers ranks ``pp_idx * (dp tp) + dp_idx * tp + tp_idx``;
    another order, e.g. ``"dp-tp-pp"`` (``pp_idx * (tp dp) + tp_idx * dp + dp_idx``), is a
    placement the planner can price. ``cp`` sits right outside ``tp`` unless named.
    """
    axes = _axes(order)
    size = {"pp": degrees.pp, "dp": degrees.dp, "cp": degrees.cp, "tp": degrees.tp}
    outer_first = axes[::-1]
    grid = torch.arange(degrees.world_size).reshape([size[a] for a in outer_first])
    grid = grid.permute([outer_first.index(a) for a in MESH_DIMS])  # -> (pp, dp, cp, tp)
    shape = tuple(grid.shape)
    groups: dict[str, list[list[int]]] = {}
    for axis, name in enumerate(MESH_DIMS):
        if name == "cp" and degrees.cp == 1:
            continue
        moved = grid.movedim(axis, -1).reshape(-1, shape[axis])  # one row per group along `name`
        groups[name] = [row.tolist() for row in moved]
    pp, dp, cp, tp = shape
    dpcp = grid.reshape(pp, dp * cp, tp)  # k = dp_idx * cp + cp_idx
    if cp > 1:
        groups["dp_cp"] = [row.tolist() for row in dpcp.movedim(1, -1).reshape(-1, dp * cp)]
    if degrees.ep > 1:
        ep = degrees.ep
        split = dpcp.reshape(pp, dp * cp // ep, ep, tp)  # k = edp_idx * ep + ep_idx
        groups["ep"] = [row.tolist() for row in split.movedim(2, -1).reshape(-1, ep)]
        groups["edp"] = [row.tolist() for row in split.movedim(1, -1).reshape(-1, dp * cp // ep)]
    return groups


@dataclass
class Layout:
    """The process groups of one job. Pass ``layout.tp_group`` etc. to each technique.

    ``cp_group`` carries the ring of context-parallel attention; ``dp_cp_group`` is where
    dense gradients are averaged when ``cp > 1`` (it is ``dp_group`` when ``cp == 1``);
    ``ep_group`` shards experts and ``edp_group`` averages their gradients. The four are
    None only in a Layout assembled by hand with ``cp == ep == 1`` (``cp_rank`` and
    ``ep_rank`` then read 0); :func:`build_layout` always fills them.
    """

    degrees: ParallelDegrees
    mesh: Any  # torch.distributed.device_mesh.DeviceMesh of shape (pp, dp, cp, tp)
    tp_group: ProcessGroup
    dp_group: ProcessGroup
    pp_group: ProcessGroup
    cp_group: ProcessGroup | None = None
    dp_cp_group: ProcessGroup | None = None
    ep_group: ProcessGroup | None = None
    edp_group: ProcessGroup | None = None

    @property
    def tp_rank(self) -> int:
        return dist.get_rank(self.tp_group)

    @property
    def dp_rank(self) -> int:
        return dist.get_rank(self.dp_group)

    @property
    def pp_rank(self) -> int:
        return dist.get_rank(self.pp_group)

    @property
    def cp_rank(self) -> int:
        return 0 if self.cp_group is None else dist.get_rank(self.cp_group)

    @property
    def ep_rank(self) -> int:
        return 0 if self.ep_group is None else dist.get_rank(self.ep_group)


def _my_group(lists: list[list[int]]) -> ProcessGroup:
    """Create every group of ``lists`` (each rank must create all of them, in the same
    order) and return the one holding this rank."""
    me, mine = dist.get_rank(), None
    for ranks in lists:
        group = dist.new_group(ranks)
        if me in ranks:
            mine = group
    assert mine is not None, f"rank {me} is in none of {lists}"
    return mine


def build_layout(degrees: ParallelDegrees, device_type: str | None = None) -> Layout:
    """Build the (pp, dp, cp, tp) ``DeviceMesh`` and its groups, plus the dp_cp, ep and edp
    groups (:func:`rank_grid`'s lists). Call on every rank, after ``init_process_group``;
    ``device_type`` defaults to "cuda" on NCCL and "cpu" otherwise."""
    from torch.distributed.device_mesh import init_device_mesh

    degrees.check_world_size(dist.get_world_size())
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    d = degrees
    mesh = init_device_mesh(device_type, (d.pp, d.dp, d.cp, d.tp), mesh_dim_names=MESH_DIMS)
    grid = rank_grid(d)
    cp_group = mesh.get_group("cp")
    dp_cp = _my_group(grid["dp_cp"]) if d.cp > 1 else mesh.get_group("dp")
    if d.ep > 1:
        ep, edp = _my_group(grid["ep"]), _my_group(grid["edp"])
    else:  # one expert group per rank: itself (cp's singleton when cp == 1)
        ep = cp_group if d.cp == 1 else _my_group([[r] for r in range(d.world_size)])
        edp = dp_cp
    return Layout(
        degrees=d,
        mesh=mesh,
        tp_group=mesh.get_group("tp"),
        dp_group=mesh.get_group("dp"),
        pp_group=mesh.get_group("pp"),
        cp_group=cp_group,
        dp_cp_group=dp_cp,
        ep_group=ep,
        edp_group=edp,
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
