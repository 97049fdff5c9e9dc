"""Context parallelism from scratch: the sequence of every attention layer split over ranks.

* :mod:`.blockwise`: attention block by block, merged by the online-softmax (log-sum-exp)
  rule, and its backward from the saved LSE (the flash-attention recurrence); the ring's
  tiles run either these readable float32 ops or torch's fused CPU flash kernel (same terms).
* :mod:`.split`: which two of ``2 cp`` chunks each rank holds (contiguous or zigzag) and the
  causal work each rank then does.
* :mod:`.ring`: ring attention, K/V (and, backward, their gradients) travelling the cp group
  in ``batch_isend_irecv`` steps that overlap the block compute.
* :mod:`.ulysses`: DeepSpeed-Ulysses, all-to-all from sequence shards to head shards and back.
* :mod:`.cost`: the arithmetic (memory per rank, bytes per step, when a ring hides).

Techniques take the cp group explicitly (``group=layout.cp_group``); nothing here reads the
layout. Proof: ``tests/test_context_parallel.py``; lesson: ``notebooks/15_long_context``.
"""

from labkit.context_parallel.blockwise import (
    block_backward,
    block_forward,
    blockwise_attention,
    causal_mask,
    merge,
)
from labkit.context_parallel.ring import RingAttention, RingStats, ring_attention
from labkit.context_parallel.split import (
    SCHEMES,
    causal_blocks,
    check_sequence,
    chunk_ids,
    shard_sequence,
    unshard_sequence,
)
from labkit.context_parallel.ulysses import heads_to_seq, seq_to_heads, ulysses_attention

__all__ = [
    "SCHEMES",
    "RingAttention",
    "RingStats",
    "block_backward",
    "block_forward",
    "blockwise_attention",
    "causal_blocks",
    "causal_mask",
    "check_sequence",
    "chunk_ids",
    "heads_to_seq",
    "merge",
    "ring_attention",
    "seq_to_heads",
    "shard_sequence",
    "ulysses_attention",
    "unshard_sequence",
]
