"""Enumerate (dp, tp, pp, micro-batch, ZeRO, recompute, virtual stages); predict memory, time, MFU.

The prediction for one candidate, per GPU of the *first* pipeline stage (the fullest one: it
holds the embedding and stashes the most micro-batches). The cut: ``l/p`` layers a stage when
p (times v) divides l, else the default spread or the candidate's ``stage_layers``
(``stages.py``); with an uneven cut, ``l/p`` below reads "the most blocks one rank holds"
(memory and communication charged on it: an upper bound), and compute is the slowest rank's:

memory
    model states   ``labkit.memory.model.model_states`` of the stage's parameter shard
                   ``P_stage = ((l/p)(12h^2 + 13h) + V h) / t + s h``, ZeRO over the dp group;
    activations    Korthikanti's per-layer bytes (``activation_bytes_per_layer``) x the layers of
                   a stage x the micro-batches in flight (1F1B: min(p, m); interleaving with v
                   virtual stages: x (1 + (p-1)/(p v))), plus one layer recomputed in full;
    workspace      a stated allowance: the fp32 logits of one micro-batch on the last stage's
                   shard (b s V / t x 4 bytes) and 1 GB for kernels and fragmentation.
time (one iteration)
    compute        m micro-batches (m = B / (dp b)) through the slowest stage: its l/p layers
                   by Megatron's per-layer FLOPs (flops.py; the recompute's extra forward when
                   on) plus, on the last stage, the logits' 6 b s h V; over t x peak x efficiency.
                   Deep pipelines of small models pay for that imbalance;
    bubble         (p-1) / v more micro-batch slots (1F1B: (p-1)/(m+p-1) of the total), each
                   at the slowest rank's time; "simulated": the schedule replayed with every
                   stage at its own time (the head's stage and an uneven cut differ);
    tp comm        per layer and micro-batch 2 all-reduces forward + 2 backward (+2 recomputed)
                   of b s h x 2 bytes, ring over t ranks (on the fast link when t fits a node);
    pp comm        per micro-batch and boundary, b s h x 2 bytes forward and backward, split t
                   ways (Megatron's scatter/gather); on the slow link once the pipeline spans nodes;
    dp comm        all-reduce (or ZeRO's reduce-scatter + all-gather; ZeRO-3 adds a gather) of
                   the stage's 16-bit gradients (2 P_stage bytes) over dp ranks, not overlapped
                   (a conservative bound); a flat ring (across nodes at a node uplink shared
                   only by the dp rings crossing it, ``GroupLink.ring_bandwidth``), or
                   hierarchical across nodes.
Each group's link class follows from the rank order (``links.py``).
MFU = model FLOPs (72 factor, no recompute) / (time x GPUs x peak).

Rank order follows Megatron's (Narayanan et al. 2021, section 3.3): tp innermost, so a tp group
spans t consecutive ranks; a dp group spans t x dp; a pp group crosses everything.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

from labkit.collectives.cost_model import hierarchical_all_reduce_time, ring_all_reduce_time
from labkit.memory.model import Precision, activation_bytes_per_layer, model_states
from labkit.models.gpt import GPTConfig
from labkit.parallel.layout import ParallelDegrees
from labkit.planner.bubble import charged_bubble
from labkit.planner.cluster import Cluster
from labkit.planner.flops import megatron_flops_per_iteration
from labkit.planner.links import group_links
from labkit.planner.stages import stage_cut

__all__ = ["MEGATRON_MIXED", "Candidate", "Prediction", "enumerate_candidates", "plan", "predict"]

ZERO_STAGES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}
WORKSPACE_BYTES = 1e9
# Megatron-LM's mixed precision as we model it: 16-bit parameters (2 bytes), gradients kept in
# an fp32 "main_grad" buffer for the optimizer (4; they are all-reduced in 16 bits), fp32 master
# weights and Adam's two moments (12): 18 bytes per parameter, 2 more than the ZeRO paper's 16.
# With 16, the 18.4B row of Table 1 would fit at t=4 (78 GB of 80) and the planner would
# prefer it.
MEGATRON_MIXED = Precision(2, 4, 12)


@dataclass(frozen=True)
class Candidate:
    dp: int
    tp: int
    pp: int
    micro_batch: int
    zero: int = 0
    recompute: str = "full"
    virtual: int = 1
    sp: bool = False
    stage_layers: tuple[int, ...] | None = None  # blocks per virtual stage; None: even/spread

    @property
    def degrees(self) -> ParallelDegrees:
        return ParallelDegrees(dp=self.dp, tp=self.tp, pp=self.pp)


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    memory: dict[str, float]  # bytes per GPU by category
    time: dict[str, float]  # seconds per iteration by part
    micro_batches: int
    fits: bool
    mfu: float
    tokens_per_second: float

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())

    @property
    def step_seconds(self) -> float:
        return sum(self.time.values())

    def row(self) -> dict[str, object]:
        c = asdict(self.candidate)
        if c["stage_layers"] is None:  # the default cut: no column
            del c["stage_layers"]
        c.update(
            GB=round(self.memory_total / 1e9, 1),
            fits=self.fits,
            step_s=round(self.step_seconds, 3),
            mfu=round(self.mfu, 3),
        )
        return c


def _stage_params(cfg: GPTConfig, tp: int, pp: int, blocks: float | None = None) -> float:
    """Parameters of the first stage's tp shard: ``blocks`` layers (default ``l/p``) and the
    embedding."""
    h = cfg.n_embd
    layers = cfg.n_layer / pp if blocks is None else blocks
    return (layers * (12 * h * h + 13 * h) + cfg.vocab_size * h) / tp + cfg.block_size * h


def predict(
    cfg: GPTConfig,
    cluster: Cluster,
    global_batch: int,
    cand: Candidate,
    *,
    efficiency: float = 0.5,
    precision: Precision = MEGATRON_MIXED,
    bubble: str = "formula",
    order: str = "tp-dp-pp",
    dp_collective: str = "ring",
) -> Prediction:
    """Memory per GPU, seconds per iteration and MFU of one candidate (module docstring).
    ``bubble``: "formula" ((p - 1)/v slots) or "simulated" (the pipeline simulator's replay of
    the schedule, :mod:`labkit.planner.bubble`). ``order``: the rank order (innermost axis
    first, :mod:`labkit.planner.links`). ``dp_collective``: "ring" (flat, paced by the slowest
    link it crosses, at ``GroupLink.ring_bandwidth``: a node's uplink shared by the dp rings
    that cross it) or "hierarchical" (inside the node, then across nodes on 1/k of the bytes,
    for a dp group with k ranks per node)."""
    if dp_collective not in ("ring", "hierarchical"):
        raise ValueError(f"dp_collective={dp_collective!r}: expected 'ring' or 'hierarchical'")
    cand.degrees.check_world_size(cluster.world_size)
    cand.degrees.check_model(hidden=cfg.n_embd, heads=cfg.n_head)
    cut = stage_cut(cfg.n_layer, cand.pp, cand.virtual, cand.stage_layers)  # names a bad cut
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
    if global_batch % (cand.dp * cand.micro_batch):
        raise ValueError(
            f"global batch {global_batch} is not divisible by "
            f"dp={cand.dp} x micro-batch {cand.micro_batch}"
        )
    s, h, a, V, L = cfg.block_size, cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.n_layer
    t, p, d, b, v = cand.tp, cand.pp, cand.dp, cand.micro_batch, cand.virtual
    m = global_batch // (d * b)
    n = cluster.world_size

    blocks = cut.most_blocks  # L / p for an even cut
    psi = _stage_params(cfg, t, p, blocks)
    states = model_states(ZERO_STAGES[cand.zero], psi, d, precision)
    per_layer = activation_bytes_per_layer(s, b, h, a, tp=t, sp=cand.sp, recompute=cand.recompute)
    in_flight = min(p, m) * (1 + (p - 1) / (p * v) if v > 1 else 1)
    acts = in_flight * blocks * per_layer
    if cand.recompute != "none":  # one layer's activations are rebuilt in full during backward
        acts += activation_bytes_per_layer(s, b, h, a, tp=t, sp=cand.sp)
    memory = {
        "parameters": states.parameters,
        "gradients": states.gradients,
        "optimizer": states.optimizer_state,
        "activations": acts,
        "workspace": b * s * V / t * 4 + WORKSPACE_BYTES,
    }

    model_flops = megatron_flops_per_iteration(global_batch, s, L, h, V, recompute=False)
    # One micro-batch on the slowest stage: its layers, plus the logits on the last stage
    # (6 b s h V: forward and backward, never recomputed). Megatron's formula per layer.
    layer = megatron_flops_per_iteration(b, s, 1, h, V, recompute=cand.recompute == "full")
    layer -= 6 * b * s * h * V  # the formula's logit term, counted once below
    if cand.recompute == "selective":
        layer += 4 * b * s * s * h  # the attention core's forward, once more
    head = 6 * b * s * h * V
    per_micro = max(cut.rank_flops(layer, head)) / (t * cluster.peak_flops * efficiency)
    compute = m * per_micro
    act_bytes = 2 * b * s * h  # one micro-batch's 16-bit hidden states
    links = group_links(cluster, d, t, p, order)
    tpl, ppl, dpl = links["tp"], links["pp"], links["dp"]
    per_ar = ring_all_reduce_time(act_bytes, t, tpl.alpha, 1 / tpl.bandwidth) if t > 1 else 0.0
    ars = 4 + (2 if cand.recompute == "full" else 0)
    tp_comm = blocks * m * ars * per_ar
    pp_comm = 2 * m * v * (ppl.alpha + act_bytes / t / ppl.bandwidth) if p > 1 else 0.0
    dp_factor = 1.5 if cand.zero == 3 else 1.0
    grad_bytes = 2 * psi  # gradients travel in 16 bits; the fp32 buffer is local
    two_level = dpl.crosses_nodes and dpl.ranks_per_node > 1 and dpl.balanced
    if dp_collective == "hierarchical" and two_level:
        # each of the k ranks of a node carries 1/k of the bytes over its own share of the
        # node's uplink (nics_per_node = k: the per-GPU bandwidth is that share)
        dp_time = hierarchical_all_reduce_time(
            grad_bytes, dpl.nodes, dpl.ranks_per_node,
            intra=(cluster.intra_latency, 1 / cluster.intra_bandwidth),
            inter=(cluster.inter_latency, 1 / cluster.inter_bandwidth),
            nics_per_node=dpl.ranks_per_node,
        )  # fmt: skip
    else:  # a flat ring: across nodes it shares an uplink only with the other dp rings
        dp_time = ring_all_reduce_time(grad_bytes, d, dpl.alpha, 1 / dpl.ring_bandwidth)
    dp_comm = dp_factor * dp_time if d > 1 else 0.0
    time = {
        "compute": compute,
        "bubble": charged_bubble(bubble, p, m, v, per_micro, cut.stage_flops(layer, head)),
        "tp_comm": tp_comm,
        "pp_comm": pp_comm,
        "dp_comm": dp_comm,
    }
    total = sum(time.values())
    return Prediction(
        candidate=cand,
        memory=memory,
        time=time,
        micro_batches=m,
        fits=sum(memory.values()) <= cluster.memory_bytes,
        mfu=model_flops / (total * n * cluster.peak_flops),
        tokens_per_second=global_batch * s / total,
    )


def enumerate_candidates(
    cfg: GPTConfig,
    cluster: Cluster,
    global_batch: int,
    *,
    micro_batches: tuple[int, ...] = (1, 2, 4, 8),
    zero_stages: tuple[int, ...] = (0,),
    recompute: tuple[str, ...] = ("full",),
    virtual: tuple[int, ...] = (1,),
    sp: tuple[bool, ...] = (False,),
    uneven: bool = False,
) -> list[Candidate]:
    """Every layout that splits the model evenly: t divides the heads (and h), p divides the
    layers (times v), dp = GPUs / (t p), and dp x micro-batch divides the global batch (and,
    interleaved, p divides the micro-batch count m). ``uneven``: also every p (times v) up to
    the layer count that does not divide it, cut by the default spread (``stages.py``)."""
    n = cluster.world_size
    divisors = [k for k in range(1, n + 1) if n % k == 0]
    out = []

    def cuts(stages: int) -> bool:  # the layers can be cut into this many stages
        return stages <= cfg.n_layer and (uneven or cfg.n_layer % stages == 0)

    for t, p in itertools.product(divisors, repeat=2):
        if n % (t * p) or cfg.n_head % t or cfg.n_embd % t or not cuts(p):
            continue
        d = n // (t * p)
        for b, z, r, v, q in itertools.product(micro_batches, zero_stages, recompute, virtual, sp):
            if global_batch % (d * b) or (v > 1 and (p == 1 or not cuts(p * v))):
                continue
            if v > 1 and (global_batch // (d * b)) % p:  # interleaving needs m % p == 0
                continue
            if q and t == 1:
                continue
            out.append(Candidate(d, t, p, b, z, r, v, q))
    return out


def plan(cfg: GPTConfig, cluster: Cluster, global_batch: int, **kwargs: object) -> list[Prediction]:
    """Predictions for every candidate, those that fit first, fastest first."""
    if global_batch < 1:
        raise ValueError(f"global batch must be >= 1, got {global_batch}")
    efficiency = float(kwargs.pop("efficiency", 0.5))  # type: ignore[arg-type]
    precision = kwargs.pop("precision", MEGATRON_MIXED)
    bubble = str(kwargs.pop("bubble", "formula"))
    order = str(kwargs.pop("order", "tp-dp-pp"))
    dp_collective = str(kwargs.pop("dp_collective", "ring"))
    cands = enumerate_candidates(cfg, cluster, global_batch, **kwargs)  # type: ignore[arg-type]
    preds = [
        predict(
            cfg,
            cluster,
            global_batch,
            c,
            efficiency=efficiency,
            precision=precision,  # type: ignore[arg-type]
            bubble=bubble,
            order=order,
            dp_collective=dp_collective,
        )
        for c in cands
    ]
    return sorted(
        preds, key=lambda r: (not r.fits, r.step_seconds, r.candidate.tp * r.candidate.pp)
    )
