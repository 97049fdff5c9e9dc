"""The planner's old time model, kept as the negative control: every FLOP at one efficiency.

Compute is Megatron's FLOPs (``flops.py``) of the slowest rank over ``t x peak x efficiency``;
tp, pp and dp communication as in :mod:`steptime`, except that the gradients travel in 16 bits
whatever the recipe keeps them in, nothing overlaps, and neither the vocab-parallel ends' tp
all-reduces, the tied embedding's gradient all-reduce nor ZeRO-3's extra gather of a tied unit
is charged (the old model's omissions, kept). ``predict(..., efficiency=0.5)`` runs
it. Against Megatron's Table 1 its TFLOP/s falls from the smallest model to the largest where
the paper's rises (``tests/test_planner_timing.py`` shows it), because one constant cannot see
that small shards and memory-bound work weigh less as h grows.
"""

from __future__ import annotations

from labkit.collectives.cost_model import hierarchical_all_reduce_time, ring_all_reduce_time
from labkit.models.gpt import GPTConfig
from labkit.planner.bubble import charged_bubble
from labkit.planner.cluster import Cluster
from labkit.planner.flops import megatron_flops_per_iteration
from labkit.planner.links import group_links
from labkit.planner.space import Candidate
from labkit.planner.stages import stage_cut

__all__ = ["single_constant_time"]


def single_constant_time(
    cfg: GPTConfig, cluster: Cluster, cand: Candidate, m: int, *, psi: float, efficiency: float,
    bubble: str = "formula", order: str = "tp-dp-pp", dp_collective: str = "ring",
) -> dict[str, float]:  # fmt: skip
    """Seconds per iteration by part: compute, bubble, tp_comm, pp_comm, dp_comm."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
    s, h, V = cfg.block_size, cfg.n_embd, cfg.vocab_size
    t, p, d, b, v = cand.tp, cand.pp, cand.dp, cand.micro_batch, cand.virtual
    cut = stage_cut(cfg.n_layer, p, v, cand.stage_layers)
    blocks = cut.most_blocks
    # One micro-batch on the slowest stage: its layers, plus the logits on the last stage
    # (6 b s h V: forward and backward, never recomputed). Megatron's formula per layer.
    layer = megatron_flops_per_iteration(b, s, 1, h, V, recompute=cand.recompute == "full")
    layer -= 6 * b * s * h * V  # the formula's logit term, counted once below
    if cand.recompute == "selective":
        layer += 4 * b * s * s * h  # the attention core's forward, once more
    head = 6 * b * s * h * V
    per_micro = max(cut.rank_flops(layer, head)) / (t * cluster.peak_flops * efficiency)
    act_bytes = 2 * b * s * h  # one micro-batch's 16-bit hidden states
    links = group_links(cluster, d, t, p, order)
    tpl, ppl, dpl = links["tp"], links["pp"], links["dp"]
    per_ar = ring_all_reduce_time(act_bytes, t, tpl.alpha, 1 / tpl.bandwidth) if t > 1 else 0.0
    ars = 4 + (2 if cand.recompute == "full" else 0)
    grad_bytes = 2 * psi  # 16 bits on the wire (the old model's undercount of fp32 recipes)
    two_level = dpl.crosses_nodes and dpl.ranks_per_node > 1 and dpl.balanced
    if dp_collective == "hierarchical" and two_level:
        dp_time = hierarchical_all_reduce_time(
            grad_bytes, dpl.nodes, dpl.ranks_per_node,
            intra=(cluster.intra_latency, 1 / cluster.intra_bandwidth),
            inter=(cluster.inter_latency, 1 / cluster.inter_bandwidth),
            nics_per_node=dpl.ranks_per_node,
        )  # fmt: skip
    else:
        dp_time = ring_all_reduce_time(grad_bytes, d, dpl.alpha, 1 / dpl.ring_bandwidth)
    return {
        "compute": m * per_micro,
        "bubble": charged_bubble(bubble, p, m, v, per_micro, cut.stage_flops(layer, head)),
        "tp_comm": blocks * m * ars * per_ar,
        "pp_comm": 2 * m * v * (ppl.alpha + act_bytes / t / ppl.bandwidth) if p > 1 else 0.0,
        "dp_comm": (1.5 if cand.zero == 3 else 1.0) * dp_time if d > 1 else 0.0,
    }
