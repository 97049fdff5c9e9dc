"""The one way to swap labkit's own collectives in: ``Comm(group, impl=...)``, counting bytes.

DDP, ZeRO and tensor parallelism all communicate through a :class:`Comm`, so switching every
technique from PyTorch's collectives to labkit's ring is one argument, ``impl="ring"``.

``Comm(group, impl="torch")`` uses torch.distributed (``reduce_scatter_single`` /
``all_gather_single``, the 2.13 names of ``reduce_scatter_tensor`` / ``all_gather_into_tensor``);
``impl="ring"`` uses labkit's own collectives where speed matters: the tuned ring
(:mod:`labkit.collectives.ring_tuned`) and, for all-reduce, :mod:`labkit.collectives.auto`
(recursive doubling below a measured size).
``Comm(None, impl="hierarchical", nodes=node_groups(k))`` all-reduces in two levels
(:mod:`labkit.collectives.hierarchical`); its reduce-scatter and all-gather stay flat (the
tuned ring over the whole group, node-ordered): a sharded optimizer's shards span the world,
and a two-level reduce-scatter would only reorder which rank owns which shard. labkit's
collectives block, so ``async_op=True`` degrades to a finished call for "ring" and
"hierarchical" (the DDP wrappers run them on a communication thread to overlap; that thread
and the main thread's tensor parallelism may communicate at once, on different groups: each
thread has its own scratch buffers, :mod:`labkit.collectives.pool`).
torch.distributed's functions are looked up at call time, so a wrapper installed on
``dist`` inside a rank (the emulated cluster's software link model) sees every call.

What travels: ``wire="accum"`` (default) or ``"input"``, for float16/bfloat16 tensors with
"ring" and "hierarchical" (:mod:`labkit.collectives.ring_tuned` states both error bounds).
"accum" stages the reduce phase's partials in float32, rounded once: precise, but it moves
twice the 16-bit bytes there. "input" sends 16-bit partials, rounded at every hop, as torch's
own collectives always do (``impl="torch"`` ignores ``wire``): the choice for compressed
gradients, whose whole point is fewer bytes (``Comm(group, "ring", wire="input")``).

Byte accounting. ``sent[op]`` is what a bandwidth-optimal (ring) algorithm sends from this
rank for the calls made: a reduce-scatter or all-gather of ``M`` bytes sends
``(N-1)/N * M``, an all-reduce twice that, each phase in the dtype it travels in (the reduce
phase of a 16-bit tensor in float32 for labkit's impls with ``wire="accum"``). That is the
quantity behind ZeRO's 2Psi / 3Psi argument (the paper rounds ``(N-1)/N`` to 1).
With ``nodes=`` (any impl), ``sent_intra[op]`` / ``sent_inter[op]`` split this rank's bytes by
link class, as the ring schedules send them, in the same dtypes: for "hierarchical"
all-reduce, phases 1 and 3 count as intra and phase 2 (``2(n-1)/n`` of this rank's chunk)
as inter; for a flat ring over node-ordered ranks, only the last rank of each node sends
across (to the next node).
``sum(sent_inter.values())`` summed over a node's ranks is what crossed its uplink.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from labkit.collectives.common import WIRES, chunk_sizes, wire_dtype

if TYPE_CHECKING:
    from labkit.collectives.hierarchical import NodeGroups

__all__ = ["Comm", "IMPLS"]

IMPLS = ("torch", "ring", "hierarchical")


def _torch_collective(new: str, old: str) -> Any:
    """``dist.<new>`` or, on older releases, ``dist.<old>``, looked up now (not at import), so
    a function patched onto ``dist`` inside a rank is the one called. torch 2.13 renamed
    reduce_scatter_tensor / all_gather_into_tensor to *_single; a GPU image may ship older."""
    return getattr(dist, new, None) or getattr(dist, old)


class _Done:
    def wait(self) -> None:
        return None


class Comm:
    """reduce_scatter (SUM) / all_gather / all_reduce (SUM) over ``group``, with byte counters.

    ``nodes``: the node layout (:func:`labkit.collectives.hierarchical.node_groups`), needed by
    ``impl="hierarchical"`` and optional otherwise (it enables the per-link-class counters);
    it must cover ``group`` (the whole world, in rank order). ``wire``: "accum" or "input",
    what 16-bit partials travel as in labkit's impls (module docstring).
    """

    def __init__(
        self,
        group: ProcessGroup | None = None,
        impl: str = "torch",
        nodes: NodeGroups | None = None,
        wire: str = "accum",
    ) -> None:
        if impl not in IMPLS:
            raise ValueError(f"unknown collective implementation {impl!r}; expected one of {IMPLS}")
        if wire not in WIRES:
            raise ValueError(f"Comm: wire must be one of {WIRES}, got {wire!r}")
        if impl == "hierarchical" and nodes is None:
            raise ValueError(
                'impl="hierarchical" needs nodes=node_groups(ranks_per_node) '
                "(labkit.collectives.hierarchical): the node layout is not guessed"
            )
        self.group = group
        self.impl = impl
        self.nodes = nodes
        self.wire = wire
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if nodes is not None:
            self._check_nodes(nodes)
        self.sent: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.sent_intra: dict[str, int] = defaultdict(int)  # by link class (with nodes=)
        self.sent_inter: dict[str, int] = defaultdict(int)

    def _check_nodes(self, nodes: NodeGroups) -> None:
        """``nodes`` must cover this Comm's group, its ranks in global (node) order."""
        ranks = list(range(dist.get_world_size()))
        if self.group is not None:
            ranks = dist.get_process_group_ranks(self.group)
        if ranks != list(range(nodes.world_size)):
            raise ValueError(
                f"nodes ({nodes.nodes} nodes x {nodes.ranks_per_node} ranks) must cover the "
                f"group, global ranks 0..{nodes.world_size - 1} in order; the group has "
                f"ranks {ranks}"
            )
        problem = nodes.problem()
        if problem is not None:
            raise ValueError(problem)

    def _count(self, op: str, t: torch.Tensor, phases: tuple[bool, bool]) -> None:
        """Count this rank's bytes for ``op`` on ``t``; ``phases`` says which of (reduce,
        gather) ran (see the module docstring)."""
        p = self.world_size
        # labkit's reduce phases move 16-bit partials as float32 with wire="accum"; torch's,
        # and wire="input", move the dtype itself; every gather moves the dtype
        wire = "input" if self.impl == "torch" else self.wire
        sizes = (wire_dtype(t.dtype, wire).itemsize, t.element_size())
        moved = [t.numel() * size for size, on in zip(sizes, phases) if on]  # each phase run
        self.sent[op] += sum(moved) * (p - 1) // p
        self.calls[op] += 1
        if self.nodes is not None:
            self._count_links(op, t, moved, sizes[0])

    def _count_links(self, op: str, t: torch.Tensor, moved: list[int], reduce_size: int) -> None:
        """Per link class, this rank's bytes for ``op`` on ``t``: ``moved`` holds the bytes of
        each phase run, ``reduce_size`` the bytes of a reduce-phase element."""
        assert self.nodes is not None
        k, n, p = self.nodes.ranks_per_node, self.nodes.nodes, self.world_size
        if self.impl == "hierarchical" and op == "all_reduce":
            chunk = chunk_sizes(t.numel(), k)[self.rank % k] * reduce_size  # phase 2's bytes
            self.sent_intra[op] += sum(m * (k - 1) // k for m in moved)
            self.sent_inter[op] += 2 * chunk * (n - 1) // n
            return
        # a flat ring: everyone sends (p-1)/p of each phase to the next rank, off-node for the
        # last rank of a node
        crossing = n > 1 and self.rank % k == k - 1
        links = self.sent_inter if crossing else self.sent_intra
        links[op] += sum(m * (p - 1) // p for m in moved)

    def reset(self) -> None:
        for counter in (self.sent, self.calls, self.sent_intra, self.sent_inter):
            counter.clear()

    @property
    def total_sent(self) -> int:
        return sum(self.sent.values())

    def reduce_scatter(self, out_shard: torch.Tensor, in_full: torch.Tensor) -> None:
        """``out_shard`` <- this rank's chunk of the SUM of ``in_full`` over ranks."""
        self._count("reduce_scatter", in_full, (True, False))
        if self.world_size == 1:
            out_shard.copy_(in_full)
        elif self.impl in ("ring", "hierarchical"):  # both: the flat tuned ring
            from labkit.collectives.ring_tuned import tuned_reduce_scatter

            tuned_reduce_scatter(out_shard, in_full, group=self.group, check=False, wire=self.wire)
        else:
            reduce_scatter = _torch_collective("reduce_scatter_single", "reduce_scatter_tensor")
            reduce_scatter(out_shard, in_full, group=self.group)

    def all_gather(
        self, out_full: torch.Tensor, in_shard: torch.Tensor, async_op: bool = False
    ) -> Any:
        """``out_full`` <- every rank's ``in_shard`` end to end. Returns a handle to ``wait()``."""
        self._count("all_gather", out_full, (False, True))
        if self.world_size == 1:
            out_full.copy_(in_shard)
        elif self.impl in ("ring", "hierarchical"):  # blocking: async degrades to sync
            from labkit.collectives.ring_tuned import tuned_all_gather

            tuned_all_gather(out_full, in_shard, group=self.group, check=False)
        else:
            all_gather = _torch_collective("all_gather_single", "all_gather_into_tensor")
            work = all_gather(out_full, in_shard, group=self.group, async_op=async_op)
            if async_op:
                return work
        return _Done()

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> Any:
        """``tensor`` <- SUM over ranks (the DDP baseline). Returns a handle to ``wait()``."""
        self._count("all_reduce", tensor, (True, True))
        if self.world_size == 1:
            return _Done()
        if self.impl == "hierarchical":  # blocking: async degrades to sync
            from labkit.collectives.hierarchical import hierarchical_all_reduce

            assert self.nodes is not None  # checked in __init__
            hierarchical_all_reduce(tensor, self.nodes, check=False, wire=self.wire)
        elif self.impl == "ring":  # labkit's ring is blocking: async degrades to sync
            from labkit.collectives.auto import all_reduce

            all_reduce(tensor, group=self.group, check=False, wire=self.wire)
        else:
            work = dist.all_reduce(tensor, group=self.group, async_op=async_op)
            if async_op:
                return work
        return _Done()
