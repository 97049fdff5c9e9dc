"""The tp term under overlapped sequence parallelism, priced from the decomposition.

``labkit.tensor_parallel.overlap`` cuts each SP all-gather (before a column-parallel GEMM) and
reduce-scatter (after a row-parallel one) into its ``t - 1`` ring steps and gives each step a
``1/t`` chunk of the GEMM to run under. Per collective of ``C`` seconds whose GEMM takes ``g``:

    exposed = (t - 1) * max(0, C / (t - 1) - g / t)  =  max(0, C - (t - 1) g / t)

each step's transfer beyond the chunk it hides under. One chunk is never under any transfer
(the last of all-gather-matmul, the first of matmul-reduce-scatter), so at best ``(t - 1)/t``
of the GEMM hides communication, and on a link slower than the GEMM every step's excess shows.
The steps' latencies are in ``C`` already (``ring_all_reduce_time``). Not charged: t smaller
GEMMs run less efficiently than one. The roofline would price that by re-reading the weight
per chunk *on top of* the math (:mod:`roofline` adds the two), +47% on the 100B model's QKV at
t = 8 (A100), far above what chunked GEMMs lose in practice, where the loads overlap the math:
``chunk_overhead`` gives that bound, for the lesson.

Which GEMM hides which collective, per layer and micro-batch: forward, the all-gather before QKV
``(T, 3h/t, h)`` and before fc ``(T, 4h/t, h)``, the reduce-scatter after the projection
``(T, h, h/t)`` and after fc2 ``(T, h, 4h/t)``; backward the mirrored collectives under the input-
gradient GEMMs of the same layers ``(T, k, n)`` (the weight-gradient GEMMs run after the ring,
as in ``overlap.py``); full recompute, the forward's again. ``C`` is one SP collective: half of
the tp all-reduce :mod:`labkit.planner.steptime` charges (``tp_comm`` without overlap), so this
module re-prices that term and nothing else. The planner's older ``tp_overlap=True`` hides
``min(tp_comm, all GEMMs)``: the bound this one refines.
"""

from __future__ import annotations

from labkit.planner.cluster import Cluster
from labkit.planner.roofline import Chip, chip_for, gemm_time
from labkit.planner.space import Candidate
from labkit.planner.stages import stage_cut

__all__ = ["chunk_overhead", "decomposed_exposed", "decomposed_tp_comm", "layer_gemms"]


def decomposed_exposed(comm: float, gemm: float, t: int) -> float:
    """Seconds left exposed of one collective of ``comm`` seconds decomposed into ``t - 1``
    ring steps, each under a ``1/t`` chunk of a ``gemm``-second GEMM."""
    if min(comm, gemm) < 0:
        raise ValueError(f"seconds must be >= 0, got comm={comm} gemm={gemm}")
    if t <= 1:
        return 0.0
    return (t - 1) * max(0.0, comm / (t - 1) - gemm / t)


def _shapes(tokens: int, h: int, t: int, passes: int) -> list[tuple[float, float, float]]:
    fwd: list[tuple[float, float, float]] = [
        (tokens, 3 * h / t, h),
        (tokens, h, h / t),
        (tokens, 4 * h / t, h),
        (tokens, h, 4 * h / t),
    ]
    bwd = [(m, k, n) for m, n, k in fwd]  # dX = dY W: (T, k) from (T, n) @ (n, k)
    return fwd + bwd + (fwd if passes == 3 else [])


def layer_gemms(chip: Chip, tokens: int, h: int, t: int, passes: int) -> list[float]:
    """Seconds of the GEMM under each SP collective of one layer and micro-batch: 4 forward,
    4 backward (input gradients), 4 more under full recompute (``passes`` = 3)."""
    return [gemm_time(chip, m, n, k) for m, n, k in _shapes(tokens, h, t, passes)]


def chunk_overhead(chip: Chip, tokens: int, h: int, t: int, passes: int) -> float:
    """What ``t`` chunk GEMMs cost beyond the whole ones on the roofline, per layer and
    micro-batch: an upper bound (module docstring), not charged by :func:`decomposed_tp_comm`."""
    return sum(t * gemm_time(chip, m / t, n, k) - gemm_time(chip, m, n, k)
               for m, n, k in _shapes(tokens, h, t, passes))  # fmt: skip


def decomposed_tp_comm(
    tp_comm: float, cfg_layers: int, hidden: int, seq: int, cluster: Cluster, cand: Candidate,
    micro_batches: int,
) -> float:  # fmt: skip
    """The blocks' exposed tp seconds when every SP collective is decomposed (module docstring),
    from ``tp_comm``: the same traffic unoverlapped (``steptime``'s term, ``tp_overlap=False``).
    ``seq``: the positions a rank's activations cover (``block_size / cp``)."""
    t = cand.tp
    if t == 1 or tp_comm == 0:
        return tp_comm
    if not cand.sp:
        raise ValueError(
            f"overlapped tp decomposes sequence parallelism's all-gather and reduce-scatter: "
            f"tp={t} needs sp=True, got sp=False"
        )
    cut = stage_cut(cfg_layers, cand.pp, cand.virtual, cand.stage_layers)
    passes = 3 if cand.recompute == "full" else 2
    layers = cut.most_blocks * micro_batches
    one = tp_comm / (layers * passes * 4)  # one SP collective: half an all-reduce
    chip = chip_for(cluster.name, cluster.peak_flops, cluster.mem_bandwidth)
    gemms = layer_gemms(chip, cand.micro_batch * seq, hidden, t, passes)
    return layers * sum(decomposed_exposed(one, g, t) for g in gemms)
