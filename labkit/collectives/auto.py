"""labkit's all-reduce: recursive doubling for small messages, the tuned ring for large ones.

The alpha-beta model (``cost_model.py``) says why: recursive doubling takes ``log2 p`` steps
but moves all ``D`` bytes at each, the ring takes ``2(p-1)`` steps of ``D/p`` bytes. Below a
crossover size latency dominates and recursive doubling wins; above it, the ring.

Where the threshold comes from. :class:`AllReduceChoice` holds it, in bytes per rank:

* ``TWO_RANK_BYTES`` (8 MB), the default on 2 ranks, measured 2026-11-26 on the 2-core machine
  under load (load average 6-9: four engineers' tests), gloo, float32, interleaved rounds::

      .venv/bin/python benchmarks/bench_collectives.py --ops all_reduce \
          --sizes-mb 1 2 4 8 16 32 64 --repeats 15 \
          --algorithms "tuned ring" "recursive doubling" "halving-doubling"

  median ms per call (slowest rank), two runs (15 rounds at 1-64 MB; a rerun, 21 rounds, 2-16):

      size     torch        tuned ring     recursive doubling   halving-doubling
      1 MB     1.37         5.85           2.77                 7.90
      2 MB     2.56 / 2.03  6.17 / 6.37    2.82 / 4.85          8.93 / 8.69
      4 MB    13.4  / 5.78 16.4  / 9.98   14.4  / 8.17         19.7  / 9.63
      8 MB     8.57 / 14.7 14.6  / 20.0   12.1  / 14.1         17.0  / 26.1
     16 MB    19.5  / 26.3 26.8  / 35.4   29.5  / 32.0         25.1  / 38.5
     32 MB    38.5         80.1           91.7                 70.4
     64 MB    91.5         106            129                  149

  Recursive doubling beat the ring at every size up to 8 MB in both runs; 16 MB split (one
  run each way); from 32 MB the ring won. On 2 ranks recursive doubling is a single swap of
  the whole vector (no pipelining, but one wait instead of two steps' worth), so it keeps
  winning far past the 1 MB of the old default. Rabenseifner's halving-doubling (``tree.py``)
  is, on 2 ranks, the ring without pieces: never the fastest here, so it is not chosen.
  Cutting recursive doubling's swap into 1 MB pieces posted in one batch (each reduced while
  the next is on the wire) was tried and measured slower on a quiet machine: torch time / its
  time at 1, 4, 8, 16 MB, two A/B runs each, 0.79/0.65, 0.97/0.79, 0.91/0.67, 0.89/0.86 in
  pieces against 1.50/0.38, 0.90/0.46, 0.94/0.89, 0.96/0.80 whole; so the swap stays whole.
  Every per-round ratio spread past 30% (the benchmark prints "noisy"); the choice rests on
  medians that agreed across the two runs. None of the three reached torch's time from 1 to
  16 MB on this loaded machine: the 4-16 MB target is still missed.
* ``SMALL_BYTES`` (1 MB), the default on 3 or more ranks (not remeasured there; on 4 ranks
  recursive doubling moves ``2D`` bytes against the ring's ``1.5D``), was measured first on
  the 2-core CI machine, gloo, 2 ranks:
  ``benchmarks/bench_collectives.py --algorithms`` times each algorithm alone, interleaved
  with torch's. Recursive doubling was as fast as the tuned ring or faster at every size up to
  1 MB (torch time / its time, 21 rounds, busy machine: 4 KB 0.71x vs 0.45x, 64 KB 1.67x vs
  0.96x, 1 MB 2.27x vs 1.33x); above that the two were within noise. On 2 ranks the pure
  model never crosses (both move ``D`` bytes and recursive doubling takes one step, not two);
  what it leaves out is that the ring adds piece by piece while the next piece is on the
  wire, which counts once the addition costs more than a latency. On 4 ranks the model's
  crossover with the link fitted in notebook 02 is about 2 MB, so 1 MB stays on the safe side.
  Remeasured on 4 ranks, 2026-11-27, quiet (load 0.3), 9 rounds, median ms per call::

      size     torch   tuned ring   recursive doubling   halving-doubling   two-shot
      1 MB     5.96    11.6          4.76                 13.4               6.39
      4 MB     7.78    12.7         12.6                  15.0              12.7
      8 MB    13.5     19.6         24.6                  25.9              23.0
     16 MB    25.3     34.1         45.7                  39.8              37.5
     32 MB    50.5     54.2         85.4                  68.0              62.7

  (two-shot, from a second run minutes later in which the ring took 10.8, 22.6, 37.7 ms at
  4, 8, 16 MB: a direct reduce-scatter and all-gather, each one batch to every peer, tried as a
  prototype and not kept: the fewest steps did not help with 4 processes on 2 cores.) The
  1 MB threshold stands: recursive doubling wins at 1 MB, the ring from 8 MB, 4 MB is a tie.
  Nothing of ours reaches gloo's native all-reduce from 4 to 16 MB on 4 ranks of this
  2-core machine, where every extra step is a context switch among 4 busy processes. Decided
  on 2026-11-27 (151 rounds; the 95% interval of the median per-round torch time / its time,
  ``bench_collectives.py --ranks 4 --repeats 151 --algorithms``, ``bench_cells.median_interval``)::

      size     tuned ring   recursive doubling   halving-doubling   naive
      4 MB     0.65-0.81    0.70-0.83            0.68-0.84          0.71-0.82
      8 MB     0.82-0.94    0.63-0.68            0.72-0.83          0.69-0.77
     16 MB     0.90-0.98    0.66-0.72            0.80-0.91          0.67-0.74
     32 MB     1.01-1.08    0.67-0.72            0.87-0.95          0.73-0.79

  Every interval below 1 is a miss that more rounds would not turn round. On 2 ranks (201
  rounds) naive reduce-and-send-back was the fastest of ours from 2 MB up and the only one
  decidedly above 1 at 8 MB (1.03-1.25); recursive doubling straddled 1 except at 4 MB
  (0.77-0.98), and the tuned ring stayed below 1 up to 8 MB. The loopback here is bound by the
  CPU's copies, not by a full-duplex link, and at p = 2 all three copy the same bytes, so the
  one with a single message in flight wins. On a real link (NCCL) it would lose 2x,
  so it is not chosen.
* :meth:`AllReduceChoice.from_fit` takes it from a fitted link instead:
  ``cost_model.crossover_bytes(p, alpha, beta)``, capped at ``SMALL_BYTES`` (the reason above).
* or pass any ``small_bytes`` you measured yourself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup, ReduceOp

from labkit.collectives.common import DEFAULT_POOL, BufferPool, group_rank_and_size, profiled
from labkit.collectives.cost_model import crossover_bytes
from labkit.collectives.ring_tuned import tuned_all_reduce
from labkit.collectives.tree import recursive_doubling_all_reduce

__all__ = ["SMALL_BYTES", "TWO_RANK_BYTES", "AllReduceChoice", "all_reduce"]

SMALL_BYTES = 1 << 20  # measured here (see the module docstring)
TWO_RANK_BYTES = 8 << 20  # measured here on 2 ranks (see the module docstring)


@dataclass(frozen=True)
class AllReduceChoice:
    """Messages of at most ``small_bytes`` bytes go by recursive doubling, larger ones by ring.

    ``small_bytes=None`` (the default) means the measured thresholds: ``TWO_RANK_BYTES`` on 2
    ranks, ``SMALL_BYTES`` on more. An explicit number holds for every world size (``0``: the
    ring always).
    """

    small_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.small_bytes is not None and self.small_bytes < 0:
            raise ValueError(f"small_bytes must be >= 0, got {self.small_bytes}")

    @classmethod
    def from_fit(cls, p: int, alpha: float, beta: float) -> AllReduceChoice:
        """The model's crossover for ``p`` ranks and a fitted link, capped at ``SMALL_BYTES``."""
        return cls(int(min(crossover_bytes(p, alpha, beta), SMALL_BYTES)))

    def limit(self, p: int) -> int:
        """The largest message (bytes) that goes by recursive doubling on ``p`` ranks."""
        if self.small_bytes is not None:
            return self.small_bytes
        return TWO_RANK_BYTES if p == 2 else SMALL_BYTES

    def algorithm(self, nbytes: int, p: int = 3) -> str:
        return "recursive doubling" if nbytes <= self.limit(p) else "ring"


@profiled("all_reduce")
def all_reduce(
    tensor: torch.Tensor,
    op: object = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    *,
    choice: AllReduceChoice = AllReduceChoice(),  # noqa: B008 (frozen: safe as a default)
    check: bool = True,
    pool: BufferPool = DEFAULT_POOL,
    wire: str = "accum",
) -> torch.Tensor:
    """All-reduce ``tensor`` in place with the algorithm ``choice`` picks for its size.

    Same contract as :func:`labkit.collectives.ring.ring_all_reduce`. Every rank picks the same
    algorithm, because validation makes every rank agree on the size first. ``wire``: what
    16-bit partials travel as, "accum" (float32, one rounding) or "input" (16 bits, a
    rounding per hop); the bytes and error bounds are in ``ring_tuned.py``.
    """
    _, p = group_rank_and_size(group)
    if choice.algorithm(tensor.numel() * tensor.element_size(), p) == "ring":
        return tuned_all_reduce(tensor, op, group, check=check, pool=pool, wire=wire)
    return recursive_doubling_all_reduce(tensor, op, group, check=check, pool=pool, wire=wire)
