"""The two-level (hierarchical) all-reduce: fast links inside a node, few bytes between nodes.

A cluster has two link classes: GPUs of one node talk over NVLink/PCIe (fast), nodes talk
over the network (slow). ``p = n * k`` ranks sit on ``n`` nodes of ``k`` ranks each; the node
of global rank ``r`` is ``r // k`` (adjacent ranks share a node, like torchrun's node ranks).
The algorithm (Horovod's hierarchical all-reduce; Goyal et al. 2017, section 4, reduce within
the server, all-reduce across servers, broadcast back, is its reduce/broadcast variant):

1. **reduce-scatter inside the node** (labkit's tuned ring over the ``k`` ranks of the node):
   local rank ``l`` ends with chunk ``l`` of the tensor, summed over its node;
2. **all-reduce across nodes** of that chunk, over the ``n`` ranks with the same local index
   (labkit's all-reduce, :mod:`labkit.collectives.auto`): every chunk ``l`` now holds the sum
   over all ``p`` ranks, and only ``D / k`` bytes per rank ever cross the slow link;
3. **all-gather inside the node**: every rank gets all ``k`` finished chunks.

Invariant: after phase 1 local rank ``l`` holds chunk ``l`` reduced over its node; after
phase 2, reduced over the world; every rank ends bit-identical (phase 3 copies one result).

Arithmetic (alpha-beta, ``D`` bytes per rank; ``cost_model.hierarchical_all_reduce_time``)::

    flat ring over p ranks      2(p-1) steps, each bounded by the slow link when n > 1:
                                2(p-1) (alpha_e + D/p beta_e)
    hierarchical                2(k-1) alpha_i + 2(k-1)/k D beta_i          (inside the node)
                              + 2(n-1) alpha_e + 2(n-1)/n (D/k) beta_e ceil(k/m)  (across)

``m`` is the number of NICs per node, shared by the node's ``k`` phase-2 flows:

* **one NIC per node** (``m = 1``): the uplink carries all ``k`` flows, ``2(n-1)/n * D``
  bytes per node, against the flat ring's ``2(p-1)/p * D`` (its one boundary flow per node):
  nearly the same bytes. The win is mostly latency: ``2(n-1)`` slow steps instead of
  ``2(p-1)``, so it is large for small messages and modest for large ones.
* **one NIC per GPU** (``m = k``, "rail-optimised", as in DGX SuperPODs): each NIC carries
  ``2(n-1)/n * D/k`` bytes, a ``k``-fold win in the bandwidth term.

Precision: 16-bit floats are reduced in float32 *across all three phases* (the partial chunk
stays float32 from the intra reduce-scatter through the inter all-reduce) and rounded to the
input dtype once, before the all-gather. Error against the exact sum ``s`` of ``p`` inputs
with ``S = sum |x_i|``: at most ``eps * |s| + (p-1) * eps32 * S`` (eps of the input dtype;
AVG divides both by ``p``); float32/float64 are summed in their own dtype, ``(p-1) eps S``.
The price: 16-bit partials travel as float32 in phases 1 and 2 (twice the bytes of a native
16-bit ring), as in ``ring_tuned.py``. ``wire="input"`` sends them in 16 bits instead (each hop
adds in float32 and rounds back, as NCCL does): phases 1 and 2 move half the bytes, phase 2's
are the ones that cross the slow links, and the ``p - 1`` additions on the way each round once,
``|error| <= (p-1) u S`` to first order (``u``: the unit roundoff, 2**-8 for bfloat16; AVG one
more rounding). The default stays "accum" because its error does not grow with ``p``.

NCCL safety: every step of every phase is one ``dist.batch_isend_irecv`` (``common.post``),
except the fold-in/hand-back of recursive doubling on a non-power-of-two node count
(blocking send/recv in matching order, as in ``tree.py``); ``tests/test_hierarchical.py``
records every call and replays it under NCCL's rules. Arguments are validated once across
the whole world (``common.validate``): a mismatch is the same ValueError on every rank, even
when only the ranks of one node disagree (validating per level would hang the other nodes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from labkit.collectives.auto import AllReduceChoice, all_reduce
from labkit.collectives.common import (
    DEFAULT_POOL,
    BufferPool,
    profiled,
    validate_in_place,
    wire_dtype,
    wire_fields,
)
from labkit.collectives.guard import guarded
from labkit.collectives.ring import ring_all_gather
from labkit.collectives.ring_tuned import BLOCK_BYTES, _reduce_scatter, _Ring
from labkit.parallel.layout import group_rank_and_size

__all__ = ["NodeGroups", "node_groups", "hierarchical_all_reduce"]


@dataclass
class NodeGroups:
    """The two levels of a job on ``nodes`` nodes of ``ranks_per_node`` ranks (they cover WORLD).

    ``intra``: this rank's node (global ranks ``node * k .. node * k + k - 1``);
    ``inter``: the ranks with this rank's local index on every node (``l, l + k, ...``).
    """

    intra: ProcessGroup
    inter: ProcessGroup
    nodes: int
    ranks_per_node: int
    mesh: Any = None  # the (node, local) DeviceMesh the groups came from, if any

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def node(self) -> int:
        """This rank's node (its rank in ``inter``)."""
        return dist.get_rank(self.inter)

    @property
    def local_rank(self) -> int:
        """This rank's index inside its node (its rank in ``intra``)."""
        return dist.get_rank(self.intra)

    def problem(self) -> str | None:
        """What is inconsistent about these groups on this rank (None: nothing)."""
        _, k = group_rank_and_size(self.intra)
        _, n = group_rank_and_size(self.inter)
        world = dist.get_world_size()
        if (k, n) != (self.ranks_per_node, self.nodes) or n * k != world:
            return (
                f"NodeGroups: intra has {k} ranks and inter {n}, but ranks_per_node="
                f"{self.ranks_per_node}, nodes={self.nodes} and world_size={world}"
            )
        return None


def node_groups(ranks_per_node: int, device_type: str | None = None) -> NodeGroups:
    """Build the node (intra) and cross-node (inter) groups from a ``(node, local)`` DeviceMesh.

    Call on every rank after ``init_process_group``. ``device_type`` defaults to "cuda" on
    NCCL and "cpu" otherwise. Raises ValueError (on every rank, before any group is made)
    unless ``ranks_per_node`` divides the world size.
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if not isinstance(ranks_per_node, int) or isinstance(ranks_per_node, bool):
        raise ValueError(f"ranks_per_node must be an int, got {ranks_per_node!r}")
    if ranks_per_node < 1 or world % ranks_per_node:
        raise ValueError(
            f"ranks_per_node={ranks_per_node} must be >= 1 and divide world_size={world} "
            "(every node holds the same number of ranks)"
        )
    nodes = world // ranks_per_node
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    # row i of the mesh = node i = global ranks i*k .. i*k + k - 1
    mesh = init_device_mesh(device_type, (nodes, ranks_per_node), mesh_dim_names=("node", "local"))
    return NodeGroups(
        intra=mesh.get_group("local"),
        inter=mesh.get_group("node"),
        nodes=nodes,
        ranks_per_node=ranks_per_node,
        mesh=mesh,
    )


@profiled("all_reduce")
def hierarchical_all_reduce(
    tensor: torch.Tensor,
    groups: NodeGroups,
    op: object = ReduceOp.SUM,
    *,
    check: bool = True,
    pool: BufferPool = DEFAULT_POOL,
    choice: AllReduceChoice = AllReduceChoice(),  # noqa: B008 (frozen: safe as a default)
    block: int = BLOCK_BYTES,
    wire: str = "accum",
) -> torch.Tensor:
    """All-reduce ``tensor`` over the whole world in place, in two levels (module docstring).

    Same contract as :func:`labkit.collectives.ring.ring_all_reduce`: contiguous float
    tensor of any shape (0-d, empty, fewer elements than ranks), SUM/AVG/MAX/MIN, equal to
    ``dist.all_reduce``. ``choice`` picks the cross-node algorithm by the chunk's size;
    ``block`` is the tuned ring's piece size; ``wire``: what 16-bit partials travel as in
    phases 1 and 2 ("accum": float32; "input": 16 bits). ``check=True`` validates once across
    the world.
    """
    problem, fields = wire_fields("hierarchical_all_reduce", wire)
    validate_in_place(
        "hierarchical_all_reduce",
        None,
        tensor,
        op=op,
        problem=groups.problem() or problem,
        check=check,
        pool=pool,
        ranks_per_node=groups.ranks_per_node,
        **fields,
    )
    flat = tensor.view(-1)  # (n,)
    n, acc = flat.numel(), wire_dtype(tensor.dtype, wire)
    if n == 0:
        return tensor
    ring = _Ring(n, tensor.element_size(), groups.intra, block)
    mine = ring.chunk(flat, ring.rank)  # my chunk of the tensor, a view
    # the chunk that carries partials through phases 1 and 2: the tensor's own chunk, or a
    # float32 staging chunk for 16-bit inputs with wire="accum" (rounded once, after phase 2)
    work = mine if acc == tensor.dtype else pool.get("hier.chunk", mine.numel(), acc, flat.device)
    sum_op = ReduceOp.SUM if op == ReduceOp.AVG else op  # AVG divides once, at the end
    with guarded("hierarchical_all_reduce", None, flat.device, check) as g:  # on WORLD
        if ring.p > 1:  # 1. reduce-scatter inside the node
            _reduce_scatter(ring, work, flat, sum_op, pool, wire)
        elif work is not mine:
            g.run(work.copy_, mine)
        if groups.nodes > 1 and work.numel():  # 2. all-reduce my chunk across nodes
            all_reduce(work, sum_op, groups.inter, choice=choice, check=False, pool=pool, wire=wire)
        if op == ReduceOp.AVG:
            g.run(work.div_, groups.world_size)
        if work is not mine:
            g.run(mine.copy_, work)  # the one rounding to a 16-bit dtype
        if ring.p > 1:  # 3. all-gather inside the node
            ring_all_gather(tensor, mine, groups.intra, check=False)
    return tensor
