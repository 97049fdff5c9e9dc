"""Which sequence chunks each context-parallel rank holds: the contiguous and the zigzag split.

The sequence of ``s`` positions is cut into ``2 * cp`` equal chunks of ``c = s / (2 cp)``;
every rank holds two of them, concatenated along the sequence (``2c`` positions):

* ``"contiguous"``: rank ``r`` holds chunks ``2r`` and ``2r + 1``, i.e. the r-th contiguous
  ``s / cp`` slice (the naive split, and Ulysses' layout).
* ``"zigzag"``: rank ``r`` holds chunks ``r`` and ``2cp - 1 - r`` (Brandon et al. 2023,
  "Striped Attention", and the zigzag of ring-flash-attention / Megatron-core's CP): an
  early chunk and its mirror late chunk.

Why zigzag, by counting (:func:`causal_blocks`): under a causal mask query chunk ``i`` needs
key chunks ``0..i``, so with the contiguous split rank ``cp-1`` computes ``4 cp - 1`` chunk
pairs and rank 0 only 3 (the last rank bounds every step); with the zigzag every rank computes
``2 cp + 1``: ``cp (2cp + 1)`` pairs in all, spread evenly.
"""

from __future__ import annotations

import torch

__all__ = [
    "SCHEMES",
    "causal_blocks",
    "check_sequence",
    "chunk_ids",
    "pair_kind",
    "shard_sequence",
    "unshard_sequence",
]

SCHEMES = ("zigzag", "contiguous")


def check_sequence(seq: int, cp: int) -> None:
    """Raise, naming both, unless ``seq`` splits into ``2 * cp`` equal chunks."""
    if cp < 1:
        raise ValueError(f"cp={cp} must be >= 1")
    if seq < 2 * cp or seq % (2 * cp):
        raise ValueError(
            f"sequence length {seq} is not divisible by 2 x cp = {2 * cp}: every context-"
            f"parallel rank holds two equal chunks (pad the sequence to "
            f"{-(-max(seq, 1) // (2 * cp)) * 2 * cp})"
        )


def chunk_ids(rank: int, cp: int, scheme: str = "zigzag") -> tuple[int, int]:
    """The two chunk indices (of ``2 * cp``) rank ``rank`` holds, in storage order."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r} is not one of {SCHEMES}")
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} out of range for cp={cp}")
    return (rank, 2 * cp - 1 - rank) if scheme == "zigzag" else (2 * rank, 2 * rank + 1)


def shard_sequence(x: torch.Tensor, cp: int, rank: int, scheme: str = "zigzag", dim: int = -2):
    """This rank's two chunks of ``x`` along ``dim``, concatenated (a copy)."""
    check_sequence(x.shape[dim], cp)
    chunks = x.chunk(2 * cp, dim=dim)  # 2cp views of s / (2cp) positions each
    a, b = chunk_ids(rank, cp, scheme)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def unshard_sequence(shards: list[torch.Tensor], scheme: str = "zigzag", dim: int = -2):
    """Inverse of :func:`shard_sequence`: the full sequence from every rank's shard."""
    cp = len(shards)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        a, b = chunk_ids(rank, cp, scheme)
        chunks[a], chunks[b] = shard.chunk(2, dim=dim)
    return torch.cat([c for c in chunks if c is not None], dim=dim)


def pair_kind(q_chunk: int, k_chunk: int, causal: bool) -> str:
    """How query chunk ``q_chunk`` meets key chunk ``k_chunk``: "full" (every key visible),
    "diag" (the same positions: a lower-triangular mask) or "skip" (every key in the future)."""
    if not causal or q_chunk > k_chunk:
        return "full"
    return "diag" if q_chunk == k_chunk else "skip"


def causal_blocks(cp: int, scheme: str, causal: bool = True) -> list[int]:
    """Chunk pairs each rank computes in one ring pass (its attention work, in units of
    ``c x c`` score tiles; a diagonal tile counts whole, as a kernel computes it)."""
    work = []
    for r in range(cp):
        mine = chunk_ids(r, cp, scheme)
        work.append(
            sum(
                pair_kind(i, j, causal) != "skip"
                for o in range(cp)
                for i in mine
                for j in chunk_ids(o, cp, scheme)
            )
        )
    return work
