"""The pipeline cut as the planner charges it: blocks and FLOPs of every stage and rank.

A candidate's ``p x v`` virtual stages hold the blocks :func:`labkit.pipeline.cut.layer_counts`
gives them: ``L / (p v)`` each when that divides, else the default spread (extras to the
middle stages), or the candidate's explicit ``stage_layers``. Rank ``r`` holds stages
``r, r + p, ..., r + (v - 1) p``, so its blocks are the sum over its chunks.

Per micro-batch, virtual stage ``s`` costs ``blocks_s x layer`` FLOPs (Megatron's per-layer
count, ``flops.py``), and the last stage adds the logits' ``6 b s h V`` (the embedding's
lookup costs no FLOPs). The slowest RANK paces the pipeline: every stage waits for it once
the pipe is full, so an iteration's compute is ``m x max_r(rank FLOPs) / (t x peak x eff)``.
With an even cut this is the old ``(L/p) layer + 6 b s h V``; an uneven cut makes the rank
with the most blocks (or the head's rank) slower, and the prediction moves with the cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from labkit.pipeline.cut import layer_counts

__all__ = ["StageCut", "stage_cut"]


@dataclass(frozen=True)
class StageCut:
    """Blocks of each of the ``p x v`` virtual stages, and what follows from them."""

    counts: tuple[int, ...]
    p: int
    v: int

    @property
    def last_rank(self) -> int:
        """The pipeline rank holding the last stage (the head)."""
        return (len(self.counts) - 1) % self.p

    @property
    def rank_blocks(self) -> tuple[int, ...]:
        """Blocks held by each pipeline rank: the sum over its v chunks."""
        return tuple(sum(self.counts[c * self.p + r] for c in range(self.v)) for r in range(self.p))

    @property
    def most_blocks(self) -> int:
        """The most blocks one rank holds (``L / p`` for an even cut)."""
        return max(self.rank_blocks)

    def stage_flops(self, layer: float, head: float) -> tuple[float, ...]:
        """FLOPs of each virtual stage per micro-batch: its blocks, the head on the last."""
        out = [k * layer for k in self.counts]
        out[-1] += head
        return tuple(out)

    def rank_flops(self, layer: float, head: float) -> tuple[float, ...]:
        """FLOPs of each pipeline rank per micro-batch (``rank_blocks x layer``, the head on
        :attr:`last_rank`)."""
        return tuple(
            k * layer + (head if r == self.last_rank else 0.0)
            for r, k in enumerate(self.rank_blocks)
        )


def stage_cut(
    n_layer: int, p: int, v: int = 1, stage_layers: Sequence[int] | None = None
) -> StageCut:
    """The cut of ``n_layer`` blocks over ``p x v`` virtual stages (ValueError names a bad one)."""
    return StageCut(tuple(layer_counts(n_layer, p * v, stage_layers)), p, v)
