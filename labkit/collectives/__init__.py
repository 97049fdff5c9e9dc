"""Collective communication from scratch, on ``torch.distributed`` point-to-point calls only.

Read in this order (lesson ``notebooks/02_collectives.ipynb``):

* ``naive.py``      reduce to a root, broadcast back: ``2(p-1) D`` bytes through one link.
* ``ring.py``       ring reduce-scatter + ring all-gather = ring all-reduce: ``2(p-1)/p D`` bytes.
* ``tree.py``       recursive doubling and a binomial broadcast: ``log2 p`` steps for small messages.
* ``cost_model.py`` the alpha-beta formulas of all of the above, and a fit of alpha and beta.
* ``bench.py``      algbw/busbw as nccl-tests define them, ours against ``torch.distributed``.
* ``common.py``     ops, chunking, peers and reusable buffers the algorithms share.
* ``comm.py``       ``Comm(group, impl="torch" | "ring")``: the one switch every technique uses,
                    with the bytes each call sends counted.

Every collective takes ``group=`` (None = WORLD) and checks, by default, that all ranks
passed the same size, op and dtype, so a mismatch is a clear error on every rank, not a hang.
"""

from labkit.collectives.comm import Comm
from labkit.collectives.common import BufferPool, chunk_sizes
from labkit.collectives.naive import naive_all_reduce
from labkit.collectives.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from labkit.collectives.tree import broadcast, recursive_doubling_all_reduce

# The names later lessons use (ZeRO shards with these two).
all_reduce = ring_all_reduce
reduce_scatter = ring_reduce_scatter
all_gather = ring_all_gather

__all__ = [
    "BufferPool",
    "Comm",
    "chunk_sizes",
    "naive_all_reduce",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "ring_all_gather",
    "recursive_doubling_all_reduce",
    "broadcast",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
]
