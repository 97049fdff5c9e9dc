"""Collective communication from scratch, on ``torch.distributed`` point-to-point calls only.

Read in this order (lesson ``notebooks/02_collectives.ipynb``):

* ``naive.py``      reduce to a root, broadcast back: ``2(p-1) D`` bytes through one link.
* ``ring.py``       ring reduce-scatter + ring all-gather = ring all-reduce: ``2(p-1)/p D`` bytes.
                    The algorithm, written to be read.
* ``tree.py``       recursive doubling and a binomial broadcast: ``log2 p`` steps, small messages.
* ``ring_tuned.py`` the same ring made fast: pieces, pipelining, reused buffers.
* ``auto.py``       labkit's all-reduce: recursive doubling up to a measured size, then the ring.
* ``hierarchical.py`` two levels for a cluster: reduce-scatter in the node, all-reduce across
                    nodes, all-gather in the node; ``node_groups(ranks_per_node)`` builds them.
* ``cost_model.py`` the alpha-beta formulas of all of the above, and a fit of alpha and beta.
* ``common.py``     the one validation, and all an algorithm imports: it re-exports
                    ``primitives.py`` (ops, chunking, batched messages), ``pool.py``,
                    ``profiled.py``.
* ``pool.py``       the reusable scratch buffers, one set per thread: any collective may run on
                    any thread, on different groups at once.
* ``profiled.py``   one ``labkit:<collective>`` profiler range per call, so a profile's
                    all-reduce count (``labkit.profiling``) includes labkit's own.
* ``nccl_order.py`` records every point-to-point call and proves the order cannot deadlock NCCL.
* ``guard.py``      the two promises of every pattern labkit builds (collectives, ring attention,
                    Ulysses, expert dispatch, the pipeline executor): shapes checked on every
                    rank (cached), and a compute step that raises half-way leaves the group
                    usable (the rank keeps its messages; every rank raises at the settle).
* ``labkit/measure/collectives.py``: algbw/busbw as nccl-tests define them, ours vs torch's;
  ``labkit/viz/collectives.py``: the lesson's pictures.
* ``comm.py``       ``Comm(group, impl="torch" | "ring" | "hierarchical", nodes=)``: the one
                    switch every technique uses, with the bytes each call sends counted.

Every collective takes ``group=`` (None = WORLD), sends only over that group (so two threads
on two groups never see each other's messages) and checks, by default, that all ranks
passed the same size, op and dtype, so a mismatch is a clear error on every rank, not a hang.
"""

from labkit.collectives.auto import AllReduceChoice
from labkit.collectives.comm import Comm
from labkit.collectives.common import BufferPool, chunk_sizes
from labkit.collectives.hierarchical import NodeGroups, hierarchical_all_reduce, node_groups
from labkit.collectives.naive import naive_all_reduce
from labkit.collectives.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from labkit.collectives.ring_tuned import tuned_all_gather, tuned_all_reduce, tuned_reduce_scatter
from labkit.collectives.tree import broadcast, recursive_doubling_all_reduce

__all__ = [
    "AllReduceChoice",
    "BufferPool",
    "Comm",
    "NodeGroups",
    "node_groups",
    "hierarchical_all_reduce",
    "chunk_sizes",
    "naive_all_reduce",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "ring_all_gather",
    "tuned_all_reduce",
    "tuned_reduce_scatter",
    "tuned_all_gather",
    "recursive_doubling_all_reduce",
    "broadcast",
]
