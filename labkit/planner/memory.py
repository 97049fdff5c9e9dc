"""The planner's memory per GPU: the one memory model (:func:`labkit.memory.per_gpu.gpu_memory`,
also behind :func:`labkit.memory.estimate.estimate`) with a candidate layout's inputs.

What the planner decides, and the model does not:

* the pipeline rank charged: under 1F1B (v = 1) every rank ``r`` is priced with its own
  blocks (``stage_cut``), its own stash of ``min(p - r, m)`` micro-batches, the embedding on
  the first and the head on the last, and the fullest one is charged: so a cut with lighter
  first stages (Megatron's uneven first/last stages) is credited for it. Interleaved
  (v > 1), the rank with the most blocks is charged with the first stage's stash,
  ``min(p, m) (1 + (p - 1)/(p v))`` micro-batches (Narayanan et al. 2021), holding the
  embedding or the head, whichever is larger: an upper bound;
* context and expert parallelism: activations of ``seq / cp`` positions; the dense parameters
  sharded over the ``dp x cp`` ranks holding them, the experts (``E / ep`` a rank, with a
  :class:`~labkit.memory.moe_cp.MoESpec`) over the ``dp cp / ep`` ranks holding the same
  experts (:mod:`labkit.memory.moe_cp`);
* ZeRO shards over the whole dp group, or under HSDP (``shard_group="node"``) over the
  ``k`` dp ranks that share a node (from the real rank grid, ``links.py``);
* the precision: Megatron's mixed precision as :data:`MEGATRON_MIXED` (18 bytes per
  parameter; gradients reduced in fp32), activations 16-bit (fp32 for fp32 training);
* the attention kernel: the model's (``cfg.attention``: "sdpa" never stores the ``5as^2b``
  scores, "explicit" does) unless the caller names one;
* a stated fixed allowance of :data:`WORKSPACE_BYTES` (1 GB) for library workspaces and
  allocator slack, inside ``workspace``.
"""

from __future__ import annotations

from typing import Any

from labkit.memory.model import Precision
from labkit.memory.moe_cp import MoESpec
from labkit.memory.per_gpu import MemoryEstimate, gpu_memory
from labkit.models.gpt import GPTConfig
from labkit.planner.cluster import Cluster
from labkit.planner.links import group_links
from labkit.planner.space import ZERO_STAGES, Candidate
from labkit.planner.stages import stage_cut

__all__ = [
    "MEGATRON_MIXED", "WORKSPACE_BYTES", "candidate_memory", "in_flight", "planner_parts",
    "shard_size",
]  # fmt: skip

WORKSPACE_BYTES = 1e9
# Megatron-LM's mixed precision as we model it: 16-bit parameters (2 bytes), gradients kept in
# an fp32 "main_grad" buffer for the optimizer (4; all-reduced in fp32 too: reduce_bytes None
# means the gradients' own dtype), fp32 master weights and Adam's two moments (12): 18 bytes
# per parameter, 2 more than the ZeRO paper's 16. A 16-bit reduce is
# ``Precision(2, 4, 12, reduce_bytes=2)``.
MEGATRON_MIXED = Precision(2, 4, 12)


def in_flight(p: int, m: int, v: int = 1) -> float:
    """Micro-batches whose activations the first stage holds: 1F1B's ``min(p, m)``, and
    interleaving's extra ``(p - 1)/(p v)`` share (Narayanan et al. 2021, section 2.2.2)."""
    return min(p, m) * (1 + (p - 1) / (p * v) if v > 1 else 1)


def shard_size(cand: Candidate, cluster: Cluster, order: str = "tp-dp-pp") -> int:
    """The ranks ZeRO shards the dense parameters over: dp x cp (context-parallel ranks hold
    the same parameters), or under HSDP the dp ranks a node holds (a dp group inside one node:
    all of dp; a ragged one, ranks unevenly over nodes, is refused)."""
    if cand.shard_group == "dp" or cand.zero == 0:
        return cand.dp * cand.cp
    dpl = group_links(cluster, cand.dp, cand.tp, cand.pp, order)["dp"]
    if not dpl.crosses_nodes:
        return cand.dp
    if not dpl.balanced:
        raise ValueError(
            f"HSDP needs the same dp ranks on every node; dp={cand.dp} tp={cand.tp} "
            f"pp={cand.pp} on nodes of {cluster.gpus_per_node} is ragged"
        )
    return dpl.ranks_per_node


def candidate_memory(
    cfg: GPTConfig, cluster: Cluster, cand: Candidate, micro_batches: int, *,
    precision: Precision = MEGATRON_MIXED, order: str = "tp-dp-pp",
    attention: str | None = None, allowance: float = WORKSPACE_BYTES,
    moe: MoESpec | None = None,
) -> MemoryEstimate:  # fmt: skip
    """Per-GPU bytes of ``cand`` with ``micro_batches`` (m) per replica (module docstring)."""
    cut = stage_cut(cfg.n_layer, cand.pp, cand.virtual, cand.stage_layers)
    p = cand.pp
    common: dict[str, Any] = dict(
        micro_batch=cand.micro_batch, seq=cfg.block_size,
        shard=shard_size(cand, cluster, order), tp=cand.tp, pp=p,
        zero=ZERO_STAGES[cand.zero], precision=precision,
        act_bytes=2 if precision.param_bytes < 4 else 4, recompute=cand.recompute,
        sp=cand.sp, attention=attention or cfg.attention, offload=cand.offload,
        allowance=allowance, cp=cand.cp, ep=cand.ep, moe=moe,
        expert_shard=cand.dp * cand.cp // cand.ep,
    )  # fmt: skip
    if p == 1 or cand.virtual > 1:
        return gpu_memory(cfg, blocks=cut.most_blocks,
                          in_flight=in_flight(p, micro_batches, cand.virtual), **common)
    ranks = [
        gpu_memory(cfg, blocks=blocks, in_flight=min(p - r, micro_batches),
                   stage="first" if r == 0 else ("last" if r == cut.last_rank else "middle"),
                   **common)
        for r, blocks in enumerate(cut.rank_blocks)
    ]  # fmt: skip
    return max(ranks, key=lambda e: e.total)


def planner_parts(mem: MemoryEstimate) -> dict[str, float]:
    """The planner's categories (``optimizer`` for ``optimizer_state``), bytes per GPU."""
    parts = mem.by_category()
    parts["optimizer"] = parts.pop("optimizer_state")
    order = ("parameters", "gradients", "optimizer", "activations", "workspace")
    return {k: parts[k] for k in order}
