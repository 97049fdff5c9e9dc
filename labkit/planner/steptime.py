"""One iteration's time for one candidate: compute, bubble and communication, each term named.

Built on :mod:`timing` (one layer, the head, the optimizer, by the card's roofline):

``compute``    m micro-batches through the slowest pipeline rank: its blocks x a layer's time
               (``timing.layer_time``: GEMMs, attention, elementwise, recompute) plus the head
               on the last rank. ``parts`` splits it by term.
``bubble``     the pipeline's idle slots (:mod:`bubble`), at the slowest rank's micro-batch time.
``tp_comm``    per layer and micro-batch, 2 all-reduces forward, 2 backward and 2 more under full
               recompute, of ``2 b s h`` bytes each on the tp group's link (sequence parallelism
               sends the same bytes as reduce-scatter + all-gather). Exposed, as Megatron 2021
               ran it; ``tp_overlap`` hides it behind the GEMMs it feeds, up to their time.
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
               reduce-scatters every micro-batch; ZeRO-1/2 gather the updated 16-bit parameters
               once. HSDP: the reduce-scatter and gathers inside the node (NVLink) and an
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
from dataclasses import dataclass, field

from labkit.collectives.cost_model import hierarchical_all_reduce_time, ring_all_reduce_time
from labkit.memory.model import Precision
from labkit.models.gpt import GPTConfig
from labkit.planner.bubble import charged_bubble
from labkit.planner.cluster import Cluster
from labkit.planner.links import group_links
from labkit.planner.memory import shard_size
from labkit.planner.roofline import chip_for
from labkit.planner.space import Candidate, offload_traffic, wire_bytes
from labkit.planner.stages import stage_cut
from labkit.planner.timing import head_time, layer_time, optimizer_time

__all__ = ["BUCKET_BYTES", "HOST_BANDWIDTH", "PCIE_BANDWIDTH", "StepTime", "step_time"]

BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's default bucket (25 MiB)
# A DGX A100 GPU's PCIe 4.0 x16 link: 32 GB/s line rate, about 25 GB/s achieved one way
PCIE_BANDWIDTH = 25e9
# host DRAM a GPU's share of: 2 AMD Rome sockets x 8 channels DDR4-3200 = 410 GB/s over 8 GPUs
HOST_BANDWIDTH = 50e9


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


def _collective_time(name: str, nbytes: float, ranks: int, cand: Candidate, cluster: Cluster,
                     order: str, dp_collective: str) -> float:  # fmt: skip
    """Seconds of one :func:`wire_bytes` collective of ``nbytes`` over ``ranks``. Over the
    whole dp group: the dp link (a flat ring paced by its slowest hop, or the hierarchical
    all-reduce); a ring reduce-scatter or all-gather is half an all-reduce. Over a node's
    share (HSDP's shard): NVLink. Across the replicas (HSDP): the inter-node link."""
    d = cand.dp
    intra = (cluster.intra_latency, 1 / cluster.intra_bandwidth)
    inter = (cluster.inter_latency, 1 / cluster.inter_bandwidth)
    if name == "grad_all_reduce_replicas":
        return ring_all_reduce_time(nbytes, ranks, *inter)
    half = 1.0 if name == "grad_all_reduce" else 0.5  # reduce-scatter / all-gather: half
    if ranks < d:  # HSDP: inside a node
        return half * ring_all_reduce_time(nbytes, ranks, *intra)
    dpl = group_links(cluster, d, cand.tp, cand.pp, order)["dp"]
    two_level = dpl.crosses_nodes and dpl.ranks_per_node > 1 and dpl.balanced
    if dp_collective == "hierarchical" and two_level:
        k = dpl.ranks_per_node
        return half * hierarchical_all_reduce_time(nbytes, dpl.nodes, k, intra=intra,
                                                   inter=inter, nics_per_node=k)  # fmt: skip
    return half * ring_all_reduce_time(nbytes, d, dpl.alpha, 1 / dpl.ring_bandwidth)


Wire = dict[str, tuple[float, int, int]]  # space.wire_bytes: {name: (bytes, ranks, count)}


def _dp_slots(cand: Candidate, cluster: Cluster, order: str, dp_collective: str, m: int,
              wire: Wire) -> dict[str, tuple[float, float]]:  # fmt: skip
    """Seconds of dp traffic by where it runs: ``{"bwd" | "fwd": (each micro-batch's, the
    step's once)}``. A collective run ``m`` times a step runs in every micro-batch's backward
    (gradients) or forward (ZeRO-3's first gather); ZeRO-3's ``2 m`` gathers split m forward,
    m backward; one run once a step sits behind the last backward (reduce) or the first
    forward (ZeRO-1/2's gather of the updated parameters)."""
    slots = {"bwd": [0.0, 0.0], "fwd": [0.0, 0.0]}
    for name, (nbytes, ranks, count) in wire.items():
        one = _collective_time(name, nbytes, ranks, cand, cluster, order, dp_collective)
        phase = "fwd" if name == "param_all_gather" else "bwd"
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
    bucket_bytes: float = BUCKET_BYTES,
) -> StepTime:  # fmt: skip
    """The named terms of one iteration (module docstring). ``params_per_gpu``: the charged
    rank's parameters before ZeRO; ``shard``: the ranks ZeRO shards over (default dp)."""
    chip = chip_for(cluster.name, cluster.peak_flops, cluster.mem_bandwidth)
    s, h, a, V = cfg.block_size, cfg.n_embd, cfg.n_head, cfg.vocab_size
    t, p, d, b, v, m = cand.tp, cand.pp, cand.dp, cand.micro_batch, cand.virtual, micro_batches
    kind = attention or cfg.attention
    cut = stage_cut(cfg.n_layer, p, v, cand.stage_layers)
    lt = layer_time(chip, b, s, h, a, tp=t, sp=cand.sp, recompute=cand.recompute,
                    attention=kind)  # fmt: skip
    head = head_time(chip, b, s, h, V, t)
    ranks = cut.rank_flops(lt.total, head)  # linear in the layer's cost: seconds per rank
    slow = max(range(p), key=lambda r: ranks[r])
    blocks = cut.rank_blocks[slow]
    per_micro = ranks[slow]
    parts = {k: m * blocks * x for k, x in lt.parts().items()}
    parts["head"] = m * head if slow == cut.last_rank else 0.0

    links = group_links(cluster, d, t, p, order)
    tpl, ppl = links["tp"], links["pp"]
    act = 2 * b * s * h  # one micro-batch's 16-bit hidden states
    ars = 4 + (2 if cand.recompute == "full" else 0)
    per_ar = ring_all_reduce_time(act, t, tpl.alpha, 1 / tpl.bandwidth) if t > 1 else 0.0
    tp_all = cut.most_blocks * m * ars * per_ar
    tp_hidden = min(tp_all, parts["gemm"]) if tp_overlap else 0.0
    pp_comm = 2 * m * v * (ppl.alpha + act / t / ppl.bandwidth) if p > 1 else 0.0

    k = shard if shard is not None else shard_size(cand, cluster, order)  # HSDP: a node's
    wire = wire_bytes(cand, params_per_gpu, precision, k, m)  # the one list of dp traffic
    slots = _dp_slots(cand, cluster, order, dp_collective, m, wire)
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
    opt_params = params_per_gpu / (k if cand.zero >= 1 else 1)
    terms = {
        "compute": m * per_micro,
        "bubble": charged_bubble(bubble, p, m, v, per_micro, cut.stage_flops(lt.total, head)),
        "tp_comm": tp_all - tp_hidden,
        "pp_comm": pp_comm,
        "dp_comm": dp_comm,
        "optimizer": optimizer_time(chip, opt_params, precision),
    }
    if cand.offload != "none":  # the step on the host, its traffic over PCIe (docstring)
        terms["optimizer"] *= chip.mem_bandwidth * chip.mem_eff / HOST_BANDWIDTH
        moved = offload_traffic(cand, params_per_gpu, precision, k)["pcie_bytes"]
        terms["offload"] = moved / PCIE_BANDWIDTH
    return StepTime(terms, parts, hidden, per_micro)
