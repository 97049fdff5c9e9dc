"""labkit's all-reduce: recursive doubling for small messages, the tuned ring for large ones.

The alpha-beta model (``cost_model.py``) says why: recursive doubling takes ``log2 p`` steps
but moves all ``D`` bytes at each, the ring takes ``2(p-1)`` steps of ``D/p`` bytes. Below a
crossover size latency dominates and recursive doubling wins; above it, the ring.

Where the threshold comes from. :class:`AllReduceChoice` holds it, in bytes per rank:

* ``SMALL_BYTES`` (the default, 1 MB) was measured on the 2-core CI machine, gloo, 2 ranks:
  ``benchmarks/bench_collectives.py --algorithms`` times each algorithm alone, interleaved
  with torch's. Recursive doubling was as fast as the tuned ring or faster at every size up to
  1 MB (torch time / its time, 21 rounds, busy machine: 4 KB 0.71x vs 0.45x, 64 KB 1.67x vs
  0.96x, 1 MB 2.27x vs 1.33x); above that the two were within noise. On 2 ranks the pure
  model never crosses (both move ``D`` bytes and recursive doubling takes one step, not two);
  what it leaves out is that the ring adds piece by piece while the next piece is on the
  wire, which counts once the addition costs more than a latency. On 4 ranks the model's
  crossover with the link fitted in notebook 02 is about 2 MB, so 1 MB stays on the safe side.
* :meth:`AllReduceChoice.from_fit` takes it from a fitted link instead:
  ``cost_model.crossover_bytes(p, alpha, beta)``, capped at ``SMALL_BYTES`` (the reason above).
* or pass any ``small_bytes`` you measured yourself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup, ReduceOp

from labkit.collectives.common import DEFAULT_POOL, BufferPool, profiled
from labkit.collectives.cost_model import crossover_bytes
from labkit.collectives.ring_tuned import tuned_all_reduce
from labkit.collectives.tree import recursive_doubling_all_reduce

__all__ = ["SMALL_BYTES", "AllReduceChoice", "all_reduce"]

SMALL_BYTES = 1 << 20  # measured here (see the module docstring)


@dataclass(frozen=True)
class AllReduceChoice:
    """Messages of at most ``small_bytes`` bytes go by recursive doubling, larger ones by ring."""

    small_bytes: int = SMALL_BYTES

    def __post_init__(self) -> None:
        if self.small_bytes < 0:
            raise ValueError(f"small_bytes must be >= 0, got {self.small_bytes}")

    @classmethod
    def from_fit(cls, p: int, alpha: float, beta: float) -> AllReduceChoice:
        """The model's crossover for ``p`` ranks and a fitted link, capped at ``SMALL_BYTES``."""
        return cls(int(min(crossover_bytes(p, alpha, beta), SMALL_BYTES)))

    def algorithm(self, nbytes: int) -> str:
        return "recursive doubling" if nbytes <= self.small_bytes else "ring"


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
    if choice.algorithm(tensor.numel() * tensor.element_size()) == "ring":
        return tuned_all_reduce(tensor, op, group, check=check, pool=pool, wire=wire)
    return recursive_doubling_all_reduce(tensor, op, group, check=check, pool=pool, wire=wire)
