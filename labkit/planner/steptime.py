"""One iteration's time for one candidate: compute, bubble and communication, each term named.

Built on :mod:`timing` (one layer, the head, the optimizer, by the card's roofline):

``compute``    m micro-batches through the slowest pipeline rank: its blocks x a layer's time
               (``timing.layer_time``: GEMMs, attention, elementwise, recompute) plus the head
               on the last rank. ``parts`` splits it by term.
``bubble``     the pipeline's idle slots (:mod:`bubble`), at the slowest rank's micro-batch time.
``tp_comm``    per layer and micro-batch, 2 all-reduces forward, 2 backward and 2 more under full
               recompute, of ``2 b s h`` bytes each on the tp group's link (sequence parallelism
               sends the same bytes as reduce-scatter + all-gather), a ring across nodes at
               ``GroupLink.ring_bandwidth`` (the uplink shared only by the rings crossing it,
               like dp's). Exposed, as Megatron 2021 ran it; ``tp_overlap`` hides it behind the
               GEMMs it feeds, up to their time.
``tp_ends_comm`` the vocab-parallel ends' tp all-reduces: one after the embedding (forward)
               and one into the head (its input gradient, backward), ``2 b s h`` each per
               micro-batch on the tp link (under SP a reduce-scatter and an all-gather, the
               same bytes); not recomputed (full recompute reruns the blocks only). Charged
               on the rank with the most tp traffic (blocks x layer's + ends): 2 at p = 1,
               1 on an even pipeline, 0 when a middle rank holds more blocks. Exposed.
``tied_comm``  a tied embedding (``cfg.tie_weights``, Megatron's GPT's default) at p > 1: the
               first and last stage sum its gradient once a step, an all-reduce of the
               ``V/t x h`` shard (the vocabulary padded to t) at ``precision.wire_bytes``
               over the two ranks, on :func:`links.embedding_link`. Exposed (after backward).
``cp_comm``    context parallelism (``cp > 1``): ring attention's K/V traffic beyond what each
               block's attention hides (:mod:`cp_ep`, which states the overlap assumption);
               every activation, GEMM and the head cover ``s / cp`` positions, attention
               ``s / cp`` queries against all ``s`` keys. ``hidden`` holds the part hidden.
``ep_comm``    expert parallelism (``ep > 1``, a MoE model): 2 all-to-alls forward and 2 backward
               (2 more under full recompute) per MoE layer and micro-batch, on the link class the
               ep group rides (:mod:`cp_ep`); MoE layers' GEMMs are the router's, the local
               experts' over their capacity (top-k active, padding included) and a shared one's.
``pp_comm``    per micro-batch, a send forward and one backward at each boundary of the rank's v
               chunks, ``2 b s h / t`` bytes (Megatron's scatter/gather), on the critical path.
``dp_comm``    every data-parallel collective :func:`space.wire_bytes` lists, with its buffer,
               group and count per step (one source for what the dp side sends): gradients at
               ``precision.wire_bytes`` (Megatron's fp32 main_grad reduced in fp32: 4 bytes; a
               16-bit reduce: 2), parameters at ``param_bytes``. The model charged: DDP and
               ZeRO-1 reduce once a step (gradients accumulate in a full local buffer);
               ZeRO-2 reduce-scatters every micro-batch (its gradient shard cannot hold the
               whole gradient, the unsharded-accumulation case; DeepSpeed's stage 2 does the
               same unless it keeps a full buffer, which would give back ZeRO-2's memory);
               ZeRO-3 (FSDP with resharding after forward) gathers the parameters before each
               micro-batch's forward and again before its backward (``2 m``) and
               reduce-scatters every micro-batch, and with a tied embedding and head on one
               rank (p = 1) gathers the tied ``V/t x h`` once more a micro-batch (one gather
               per module using it); ZeRO-1/2 gather the updated 16-bit parameters once.
               HSDP: the reduce-scatter and gathers inside the node (NVLink) and an
               all-reduce of the ``1/k`` shard across nodes, as often as the reduce-scatter.
               Without overlap (Megatron 2021's DDP reduces after backward) all of it is
               exposed. With ``dp_overlap`` each micro-batch's share runs behind that
               micro-batch's backward (reduces, ZeRO-3's second gather) or forward (gathers)
               in buckets of ``bucket_bytes`` (the last bucket never hides), a once-a-step
               reduce behind the last backward, a once-a-step gather behind the first forward:
               ``hidden`` holds what was hidden.
``optimizer``  Adam's memory-bound step over the GPU's shard (``timing.optimizer_time``); under
               CPU offload (ZeRO-Offload, Ren et al. 2021) the step streams host DRAM instead
               (``HOST_BANDWIDTH`` a GPU) and ``offload`` charges the PCIe transfer of the
               gradients down and the 16-bit parameters back (``PCIE_BANDWIDTH``), exposed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from labkit.collectives.cost_model import hierarchical_all_reduce_time, ring_all_reduce_time
from labkit.hardware import value
from labkit.memory.model import Precision
from labkit.memory.moe_cp import MoESpec
from labkit.models.gpt import GPTConfig
from labkit.planner.bubble import charged_bubble
from labkit.planner.cluster import Cluster
from labkit.planner.cp_ep import a2a_seconds, moe_mlp_shapes, ring_exposed
from labkit.planner.links import GroupLink, embedding_link, group_links
from labkit.planner.memory import shard_size
from labkit.planner.offload import offload_traffic
from labkit.planner.roofline import chip_for
from labkit.planner.space import Candidate, wire_bytes
from labkit.planner.stages import stage_cut
from labkit.planner.timing import (
    LayerTime,
    attention_time,
    head_time,
    layer_time,
    optimizer_time,
)

__all__ = ["BUCKET_BYTES", "HOST_BANDWIDTH", "PCIE_BANDWIDTH", "StepTime", "step_time"]

BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's default bucket (25 MiB)
# A DGX A100 GPU's PCIe 4.0 x16 link to the host, and its share of the host's DRAM bandwidth
# (hardware catalog: a100.host_link, a100.host_dram_share, with their sources)
PCIE_BANDWIDTH = value("a100.host_link")
HOST_BANDWIDTH = value("a100.host_dram_share")


@dataclass(frozen=True)
class StepTime:
    """``terms`` sum to the iteration's seconds; ``parts`` split ``compute``; ``hidden`` is
    communication overlapped with compute (not in the sum)."""

    terms: dict[str, float]
    parts: dict[str, float]
    hidden: dict[str, float] = field(default_factory=dict)
    per_micro: float = 0.0

    @property
    def seconds(self) -> float:
        return sum(self.terms.values())


def _collective_time(name: str, nbytes: float, ranks: int, group: int, link: GroupLink,
                     cluster: Cluster, dp_collective: str) -> float:  # fmt: skip
    """Seconds of one :func:`wire_bytes` collective of ``nbytes`` over ``ranks``, for a
    gradient group of ``group`` ranks on ``link`` (dp, dp x cp, or the experts' edp). Over the
    whole group: its link (a flat ring paced by its slowest hop, or the hierarchical
    all-reduce); a ring reduce-scatter or all-gather is half an all-reduce. Over a node's
    share (HSDP's shard): NVLink. Across the replicas (HSDP): the inter-node link."""
    intra = (cluster.intra_latency, 1 / cluster.intra_bandwidth)
    inter = (cluster.inter_latency, 1 / cluster.inter_bandwidth)
    if name.endswith("grad_all_reduce_replicas"):
        return ring_all_reduce_time(nbytes, ranks, *inter)
    half = 1.0 if name.endswith("grad_all_reduce") else 0.5  # reduce-scatter / all-gather
    if ranks < group:  # HSDP: inside a node
        return half * ring_all_reduce_time(nbytes, ranks, *intra)
    two_level = link.crosses_nodes and link.ranks_per_node > 1 and link.balanced
    if dp_collective == "hierarchical" and two_level:
        k = link.ranks_per_node
        return half * hierarchical_all_reduce_time(nbytes, link.nodes, k, intra=intra,
                                                   inter=inter, nics_per_node=k)  # fmt: skip
    return half * ring_all_reduce_time(nbytes, group, link.alpha, 1 / link.ring_bandwidth)


Wire = dict[str, tuple[float, int, int]]  # space.wire_bytes: {name: (bytes, ranks, count)}


def _dp_slots(cluster: Cluster, dp_collective: str, m: int,
              groups: list[tuple[Wire, int, GroupLink]]) -> dict[str, tuple[float, float]]:
    """Seconds of dp traffic by where it runs: ``{"bwd" | "fwd": (each micro-batch's, the
    step's once)}``. A collective run ``m`` times a step runs in every micro-batch's backward
    (gradients) or forward (ZeRO-3's first gather); ZeRO-3's ``2 m`` gathers split m forward,
    m backward; one run once a step sits behind the last backward (reduce) or the first
    forward (ZeRO-1/2's gather of the updated parameters)."""
    slots = {"bwd": [0.0, 0.0], "fwd": [0.0, 0.0]}
    items = [(n, w, g, link) for wire, g, link in groups for n, w in wire.items()]
    for name, (nbytes, ranks, count), group, link in items:
        one = _collective_time(name, nbytes, ranks, group, link, cluster, dp_collective)
        phase = "fwd" if name.endswith("param_all_gather") else "bwd"
        if count == 1:
            slots[phase][1] += one
        elif count == m:
            slots[phase][0] += one
        elif count == 2 * m:  # ZeRO-3: before each forward and again before each backward
            slots["fwd"][0] += one
            slots["bwd"][0] += one
        else:
            raise ValueError(f"{name}: {count} times a step with m={m}: no slot for it")
    return {k: (v[0], v[1]) for k, v in slots.items()}


def step_time(
    cfg: GPTConfig, cluster: Cluster, cand: Candidate, micro_batches: int, *,
    params_per_gpu: float, precision: Precision, attention: str | None = None,
    order: str = "tp-dp-pp", bubble: str = "formula", dp_collective: str = "ring",
    shard: int | None = None, dp_overlap: bool = False, tp_overlap: bool = False,
    bucket_bytes: float = BUCKET_BYTES, moe: MoESpec | None = None,
    expert_params: float = 0.0,
) -> StepTime:  # fmt: skip
    """The named terms of one iteration (module docstring). ``params_per_gpu``: the charged
    rank's parameters before ZeRO, ``expert_params`` of them the routed experts' (a MoE model,
    ``moe``); ``shard``: the ranks ZeRO shards the dense ones over (default dp x cp)."""
    chip = chip_for(cluster.name, cluster.peak_flops, cluster.mem_bandwidth)
    s, h, a, V = cfg.block_size // cand.cp, cfg.n_embd, cfg.n_head, cfg.vocab_size
    t, p, d, b, v, m = cand.tp, cand.pp, cand.dp, cand.micro_batch, cand.virtual, micro_batches
    c, e = cand.cp, cand.ep
    kind = attention or cfg.attention
    cut = stage_cut(cfg.n_layer, p, v, cand.stage_layers)
    common = dict(tp=t, sp=cand.sp, recompute=cand.recompute, attention=kind, cp=c)
    lt = layer_time(chip, b, s, h, a, **common)  # type: ignore[arg-type]
    n_moe = moe.moe_blocks(cfg.n_layer, cut.most_blocks) if moe else 0
    if moe is not None:  # the average layer: MoE layers spread evenly over the stages
        lm = layer_time(chip, b, s, h, a, mlp=moe_mlp_shapes(moe, b * s, h, t, e),
                        **common)  # type: ignore[arg-type]  # fmt: skip
        w = moe.moe_layers(cfg.n_layer) / cfg.n_layer
        lt = LayerTime(*(w * x + (1 - w) * y for x, y in zip(lm.parts().values(),
                                                             lt.parts().values())))  # fmt: skip
    head = head_time(chip, b, s, h, V, t)
    ranks = cut.rank_flops(lt.total, head)  # linear in the layer's cost: seconds per rank
    slow = max(range(p), key=lambda r: ranks[r])
    blocks = cut.rank_blocks[slow]
    per_micro = ranks[slow]
    parts = {k: m * blocks * x for k, x in lt.parts().items()}
    parts["head"] = m * head if slow == cut.last_rank else 0.0

    links = group_links(cluster, d, t, p, order, cp=c, ep=e)
    tpl, ppl = links["tp"], links["pp"]
    act = 2 * b * s * h  # one micro-batch's 16-bit hidden states (s / cp positions)
    ars = 4 + (2 if cand.recompute == "full" else 0)
    per_ar = ring_all_reduce_time(act, t, tpl.alpha, 1 / tpl.ring_bandwidth) if t > 1 else 0.0
    tp_all = cut.most_blocks * m * ars * per_ar
    tp_hidden = min(tp_all, parts["gemm"]) if tp_overlap else 0.0
    ends = max(k * ars + (r == 0) + (r == cut.last_rank) for r, k in enumerate(cut.rank_blocks))
    tp_ends = m * (ends - cut.most_blocks * ars) * per_ar  # the ends' all-reduces (docstring)
    wte = -(-V // t) * h  # the tied weight's tp shard: V padded to a multiple of t, / t
    tied = cfg.tie_weights
    pp_comm = 2 * m * v * (ppl.alpha + act / t / ppl.bandwidth) if p > 1 else 0.0

    k = shard if shard is not None else shard_size(cand, cluster, order)  # HSDP: a node's
    experts = expert_params if e > 1 else 0.0  # at ep = 1 the experts shard like the rest
    dense_link = links["dp_cp"] if c > 1 else links["dp"]
    flat = replace(cand, dp=d * c, cp=1, ep=1)  # dense gradients: averaged over dp x cp
    both = wte if tied and p == 1 else 0.0  # ZeRO-3 gathers a tied unit per use (docstring)
    dense = wire_bytes(flat, params_per_gpu - experts, precision, k, m, tied=both)
    groups = [(dense, d * c, dense_link)]
    k_e = d * c // e
    if experts:  # the experts' gradients over the ranks holding the same experts (edp)
        ewire = wire_bytes(replace(flat, dp=k_e), experts, precision, k_e, m)
        groups.append(({f"expert_{n}": x for n, x in ewire.items()}, k_e, links["edp"]))
    slots = _dp_slots(cluster, dp_collective, m, groups)
    (bwd_each, bwd_once), (fwd_each, fwd_once) = slots["bwd"], slots["fwd"]
    charged = m * (bwd_each + fwd_each) + bwd_once + fwd_once
    hidden = {"tp_comm": tp_hidden}
    if dp_overlap:
        buckets = max(1, math.ceil(params_per_gpu * precision.wire_bytes / bucket_bytes))
        window_bwd = blocks * (lt.gemm * 2 / 3 + lt.attention / 2 + lt.elementwise * 2 / 3)
        window_fwd = per_micro - window_bwd

        def exposed(load: float, window: float) -> float:  # the last bucket never hides
            return max(load / buckets, load - window) if load > 0 else 0.0

        dp_comm = ((m - 1) * (exposed(bwd_each, window_bwd) + exposed(fwd_each, window_fwd))
                   + exposed(bwd_each + bwd_once, window_bwd)
                   + exposed(fwd_each + fwd_once, window_fwd))  # fmt: skip
        hidden["dp_comm"] = charged - dp_comm
    else:
        hidden["dp_comm"] = 0.0
        dp_comm = charged
    sharded = cand.zero >= 1
    opt_params = (params_per_gpu - experts) / (k if sharded else 1) + experts / (
        k_e if sharded else 1)  # fmt: skip
    terms = {
        "compute": m * per_micro,
        "bubble": charged_bubble(bubble, p, m, v, per_micro, cut.stage_flops(lt.total, head)),
        "tp_comm": tp_all - tp_hidden,
        "pp_comm": pp_comm,
        "dp_comm": dp_comm,
        "optimizer": optimizer_time(chip, opt_params, precision),
    }
    if t > 1:
        terms["tp_ends_comm"] = tp_ends
    if tied and p > 1:  # the tied embedding's gradient over the first and last stage
        el = embedding_link(cluster, d, t, p, order, cp=c)
        nbytes = wte * precision.wire_bytes
        terms["tied_comm"] = ring_all_reduce_time(nbytes, 2, el.alpha, 1 / el.ring_bandwidth)
    if c > 1:  # ring attention's K/V beyond what each block hides (cp_ep.py)
        a_fwd, a_bwd = attention_time(chip, b, s, h, a, t, kind, True, c)
        out, hid = ring_exposed(cfg, b, t, c, a_fwd, a_bwd, links["cp"], cand.recompute)
        terms["cp_comm"] = m * cut.most_blocks * out
        hidden["cp_comm"] = m * cut.most_blocks * hid
    if moe is not None and e > 1:  # 2 all-to-alls forward, 2 backward (+2 recomputed)
        count = 4 + (2 if cand.recompute == "full" else 0)
        one = a2a_seconds(moe, b * s, h, t, e, links["ep"], cluster)
        terms["ep_comm"] = m * n_moe * count * one
    if cand.offload != "none":  # the step on the host, its traffic over PCIe (docstring)
        terms["optimizer"] *= chip.mem_bandwidth * chip.mem_eff / HOST_BANDWIDTH
        moved = offload_traffic(cand, params_per_gpu, precision, k)["pcie_bytes"]
        terms["offload"] = moved / PCIE_BANDWIDTH
    return StepTime(terms, parts, hidden, per_micro)
