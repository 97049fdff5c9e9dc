"""ZeRO-3 / FSDP across nodes at scale, from first principles, against published runs.

Fully sharded data parallelism (Rajbhandari et al. 2020's stage 3; PyTorch FSDP, Zhao et al.
2023, arXiv 2304.11277) gathers each unit's parameters before it runs and reduce-scatters its
gradients after. One unit is one transformer block (FSDP's usual wrap; DeepSpeed coalesces a
block's tensors into its prefetch bucket), so per micro-batch and block, over the ``n`` ranks
of the dp group:

* messages: an all-gather of the block's 16-bit parameters ``P = (12 h^2 + 13 h) / t`` before
  its forward, again before its backward (reshard after forward), and a reduce-scatter of its
  gradients after its backward; the root unit (embedding and tied head, ``V h / t``) likewise;
* a ring collective of ``S`` bytes: ``n - 1`` steps, each paying the slowest hop's latency
  ``alpha`` and moving ``S / n``: ``(n - 1) alpha + (n - 1)/n S / B`` (NCCL's all-gather and
  reduce-scatter are rings). ``B`` is the network's share a ring gets: over nodes, the uplink
  shared only by the rings that cross it (``GroupLink.ring_bandwidth``: a GPU's NIC times the
  group's ranks on a node). The latency term grows with ``n`` while the bytes do not shrink:
  at thousands of ranks the rings are latency-bound;
* what prefetch hides: forward, the next block's gather under this block's compute, so a
  block costs ``max(F, G)``; backward, the previous block's gather and the next's
  reduce-scatter share the network under this block's backward (recompute included):
  ``max(B, G + R)``. Without backward prefetch the gather waits for the hook: ``G + max(B, R)``.
  The first gather and the last reduce-scatter of a pass never hide.

A step is ``m`` micro-batches of that (FSDP re-gathers every micro-batch), plus the sharded
optimizer step. :func:`labkit.planner.plan.predict` charges this schedule as ``dp_comm`` for a
ZeRO-3 candidate with ``dp_overlap`` and p = 1 (compute and tensor-parallel terms stay the
roofline's); :mod:`labkit.planner.zero3_runs` checks it against published runs.
"""

from __future__ import annotations

from labkit.collectives.cost_model import ring_all_gather_time, ring_reduce_scatter_time
from labkit.memory.model import Precision
from labkit.models.gpt import GPTConfig
from labkit.planner.cluster import Cluster
from labkit.planner.links import group_links
from labkit.planner.roofline import chip_for
from labkit.planner.space import Candidate
from labkit.planner.timing import layer_time

__all__ = ["BF16_FSDP", "zero3_schedule"]

# FSDP's mixed precision as the papers ran it: 16-bit parameters and reduce-scatter, fp32
# gradient shard, master weights and Adam's moments
BF16_FSDP = Precision(2, 4, 12, reduce_bytes=2)


def _ring(kind: str, nbytes: float, n: int, alpha: float, bw: float) -> float:
    if n == 1:
        return 0.0
    op = ring_all_gather_time if kind == "gather" else ring_reduce_scatter_time
    return op(nbytes, n, alpha, 1 / bw)


def zero3_schedule(
    cfg: GPTConfig, cluster: Cluster, cand: Candidate, micro_batches: int,
    precision: Precision = BF16_FSDP, order: str = "tp-dp-pp", attention: str | None = None,
    prefetch: bool = True,
) -> dict[str, float]:  # fmt: skip
    """Seconds a step of ZeRO-3 over ``cand``'s dp group leaves exposed (module docstring):
    ``gather`` and ``reduce_scatter``, and ``latency``, every ring's per-step latency summed
    (exposed or not: reported, part of the two, not added). For ``pp = 1`` (FSDP's layout);
    compute per block is the roofline's (:func:`labkit.planner.timing.layer_time`)."""
    if cand.zero != 3 or cand.pp != 1 or max(cand.cp, cand.ep) > 1 or cand.shard_group != "dp":
        raise ValueError(f"the ZeRO-3 block schedule needs zero=3, pp=cp=ep=1 over the whole "
                         f"dp group; got {cand}")  # fmt: skip
    d, t, m = cand.dp, cand.tp, micro_batches
    h, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    chip = chip_for(cluster.name, cluster.peak_flops, cluster.mem_bandwidth)
    lt = layer_time(chip, cand.micro_batch, cfg.block_size, h, cfg.n_head, tp=t, sp=cand.sp,
                    recompute=cand.recompute, attention=attention or cfg.attention)  # fmt: skip
    fwd = (lt.total - lt.recompute) / 3  # forward is a third of forward + backward
    bwd = lt.total - fwd  # backward, with the recomputed forward in its window
    link = group_links(cluster, d, t, 1, order)["dp"]
    bw, alpha = link.ring_bandwidth, link.alpha
    block = (12 * h * h + 13 * h) / t
    G = _ring("gather", block * precision.param_bytes, d, alpha, bw)
    R = _ring("scatter", block * precision.wire_bytes, d, alpha, bw)
    root = V * h / t  # embedding and tied head: one more unit, gathered and reduced once
    G0 = _ring("gather", root * precision.param_bytes, d, alpha, bw)
    R0 = _ring("scatter", root * precision.wire_bytes, d, alpha, bw)
    over = max(0.0, G + R - bwd) if prefetch else G + max(0.0, R - bwd)  # a block's excess
    share = G / (G + R) if prefetch and G + R > 0 else 1.0  # of it, the gather's (rest: R's)
    gather = G0 + G + L * max(0.0, G - fwd) + G + L * over * share
    scatter = L * over * (1 - share) + R + R0
    return {"gather": m * gather, "reduce_scatter": m * scatter,
            "latency": m * (3 * L + 3) * (d - 1) * alpha if d > 1 else 0.0}  # fmt: skip
