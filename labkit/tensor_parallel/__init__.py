"""Megatron-style tensor parallelism (Shoeybi et al. 2019) and sequence parallelism
(Korthikanti et al. 2022), built by transforming a labkit GPT.

* ``mappings.py``       f, g and the sequence-parallel all-gather / reduce-scatter (autograd)
* ``layers.py``         ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
* ``cross_entropy.py``  the loss over a vocabulary split across ranks
* ``random.py``         dropout masks: equal where activations are replicated
* ``transform.py``      GPT -> its tensor-parallel version (``tensor_parallel``)
* ``overlap.py``        the SP all-gather / reduce-scatter decomposed under their GEMMs
  (``overlap_schedule.py``: the chunk orders and their check; ``overlap_ring.py``: the ring steps)
"""

from labkit.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from labkit.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from labkit.tensor_parallel.mappings import (
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    reduce_scatter_to_sp,
)
from labkit.tensor_parallel.overlap import (
    OverlappedColumnLinear,
    OverlappedRowLinear,
    all_gather_linear,
    linear_reduce_scatter,
)
from labkit.tensor_parallel.random import RegionDropout, seeded_dropout
from labkit.tensor_parallel.transform import (
    TensorParallelGPT,
    TPConfig,
    agree_on_config,
    check_tp,
    tensor_parallel,
)

__all__ = [
    "ColumnParallelLinear",
    "OverlappedColumnLinear",
    "OverlappedRowLinear",
    "RegionDropout",
    "RowParallelLinear",
    "TPConfig",
    "TensorParallelGPT",
    "VocabParallelEmbedding",
    "agree_on_config",
    "all_gather_linear",
    "check_tp",
    "copy_to_tp",
    "gather_from_sp",
    "linear_reduce_scatter",
    "reduce_from_tp",
    "reduce_scatter_to_sp",
    "seeded_dropout",
    "tensor_parallel",
    "vocab_parallel_cross_entropy",
]
