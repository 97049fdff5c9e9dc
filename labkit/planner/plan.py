"""Predict each candidate's memory, time and MFU, and rank them (candidates: ``space.py``).

The prediction for one candidate, per GPU of the *first* pipeline stage (the fullest one: it
holds the embedding and stashes the most micro-batches). The cut: ``l/p`` layers a stage when
p (times v) divides l, else the default spread or the candidate's ``stage_layers``
(``stages.py``); with an uneven cut, ``l/p`` below reads "the most blocks one rank holds"
(memory and communication charged on it: an upper bound), and compute is the slowest rank's:

memory
    the one memory model (``labkit.memory.per_gpu.gpu_memory``, the same as
    ``labkit.memory.estimate``) with the candidate's inputs (``memory.py``): model states of the
    stage's parameter shard under ZeRO (over dp, or a node under HSDP; offload to the host),
    Korthikanti's activations for the attention kernel and recompute policy x the micro-batches
    in flight, the largest transient, and a stated 1 GB allowance. Fits: total <= the card;
    risky: fits by less than 5% (``space.py``).
time (one iteration)
    the card's roofline (``steptime.py`` on ``timing.py`` and ``roofline.py``; every constant's
    source in ``docs/planner.md``): compute (m = B / (dp b) micro-batches through the slowest
    pipeline rank: GEMMs by shape, attention by kernel, memory-bound elementwise traffic,
    recompute per policy, the head on the last rank), bubble ((p-1)/v slots, or "simulated": the
    schedule replayed), tp comm (exposed unless ``tp_overlap``), the vocab-parallel ends' tp
    all-reduces, pp comm (on the critical path), a tied embedding's gradient all-reduce over the
    pipeline's ends (``cfg.tie_weights``), dp comm (every collective ``space.wire_bytes`` lists,
    per micro-batch or per step, gradients at ``precision.wire_bytes``; exposed, or behind
    backward up to the last bucket with ``dp_overlap``; ZeRO-3 at p = 1 with ``dp_overlap``:
    FSDP's per-block schedule, ``zero3.py``), optimizer (and offload's PCIe traffic).
    ``efficiency=`` instead runs the old single constant (``single_constant.py``: every FLOP at
    that fraction of peak, 16-bit dp traffic), kept as the negative control.
Each group's link class follows from the rank order (``links.py``).
Context and expert parallelism (``cp``, ``ep``; a MoE model as ``moe=``, a
:class:`~labkit.memory.moe_cp.MoESpec`): memory divides activations by cp and the experts by
ep (``labkit.memory.moe_cp``); time adds ``cp_comm`` (ring K/V beyond what attention hides)
and ``ep_comm`` (the all-to-alls on the ep group's link), MoE GEMMs at top-k (``cp_ep.py``).
MFU = model FLOPs (72 factor, no recompute; a MoE's MLPs at top-k, ``cp_ep.moe_model_flops``)
/ (time x GPUs x peak).

Rank order follows Megatron's (Narayanan et al. 2021, section 3.3): tp innermost, so a tp group
spans t consecutive ranks; a dp group spans t x dp; a pp group crosses everything.
"""

from __future__ import annotations

from labkit.memory.model import Precision
from labkit.memory.moe_cp import MoESpec
from labkit.models.gpt import GPTConfig
from labkit.planner.cluster import Cluster
from labkit.planner.cp_ep import moe_model_flops
from labkit.planner.flops import megatron_flops_per_iteration
from labkit.planner.memory import (
    MEGATRON_MIXED,
    WORKSPACE_BYTES,
    candidate_memory,
    planner_parts,
)  # fmt: skip
from labkit.planner.single_constant import single_constant_time
from labkit.planner.space import (
    ZERO_STAGES,
    Candidate,
    Prediction,
    enumerate_candidates,
    hardware_flops,
)
from labkit.planner.stages import stage_cut
from labkit.planner.steptime import step_time
from labkit.planner.tp_overlap import decomposed_tp_comm
from labkit.planner.zero3 import zero3_schedule

__all__ = [
    "MEGATRON_MIXED", "WORKSPACE_BYTES", "ZERO_STAGES", "Candidate", "Prediction",
    "enumerate_candidates", "plan", "predict",
]  # fmt: skip


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
    efficiency: float | None = None,
    precision: Precision = MEGATRON_MIXED,
    bubble: str = "formula",
    order: str = "tp-dp-pp",
    dp_collective: str = "ring",
    attention: str | None = None,
    dp_overlap: bool = False,
    tp_overlap: bool | str = False,
    moe: MoESpec | None = None,
) -> Prediction:
    """Memory per GPU, seconds per iteration and MFU of one candidate (module docstring).
    ``bubble``: "formula" ((p - 1)/v slots) or "simulated" (the pipeline simulator's replay of
    the schedule, :mod:`labkit.planner.bubble`). ``order``: the rank order (innermost axis
    first, :mod:`labkit.planner.links`). ``dp_collective``: "ring" (flat, paced by the slowest
    link it crosses, at ``GroupLink.ring_bandwidth``: a node's uplink shared by the dp rings
    that cross it) or "hierarchical" (inside the node, then across nodes on 1/k of the bytes,
    for a dp group with k ranks per node). ``attention``: the kernel the memory and time
    models assume ("sdpa" or "explicit"; default the model's, ``cfg.attention``).
    ``efficiency``: None, the card's roofline; a float, the old single constant.
    ``dp_overlap`` / ``tp_overlap``: hide dp traffic behind backward (bucketed), tp traffic
    behind the GEMMs (:mod:`labkit.planner.steptime`); ``tp_overlap="decomposed"``: each SP
    collective in ring steps under chunks of its GEMM (:mod:`labkit.planner.tp_overlap`).
    ``moe``: the model's MoE layers (needed for ``ep > 1``; the roofline only)."""
    if dp_collective not in ("ring", "hierarchical"):
        raise ValueError(f"dp_collective={dp_collective!r}: expected 'ring' or 'hierarchical'")
    if tp_overlap not in (False, True, "decomposed"):
        raise ValueError(f"tp_overlap={tp_overlap!r}: expected False, True or 'decomposed'")
    cand.degrees.check_world_size(cluster.world_size)
    cand.degrees.check_model(hidden=cfg.n_embd, heads=cfg.n_head, seq=cfg.block_size)
    if cand.ep > 1 and (moe is None or moe.n_experts % cand.ep):
        raise ValueError(f"ep={cand.ep} needs a MoE model (moe=) whose experts it divides")
    if efficiency is not None and (moe is not None or cand.cp > 1):
        raise ValueError(f"a MoE model or cp={cand.cp} > 1 is priced on the roofline only "
                         f"(efficiency=None), got efficiency={efficiency}")  # fmt: skip
    stage_cut(cfg.n_layer, cand.pp, cand.virtual, cand.stage_layers)  # names a bad cut
    if efficiency is not None and not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
    if global_batch % (cand.dp * cand.micro_batch):
        raise ValueError(
            f"global batch {global_batch} is not divisible by "
            f"dp={cand.dp} x micro-batch {cand.micro_batch}"
        )
    s, h, V, L = cfg.block_size, cfg.n_embd, cfg.vocab_size, cfg.n_layer
    d, b = cand.dp, cand.micro_batch
    m = global_batch // (d * b)
    n = cluster.world_size

    mem = candidate_memory(cfg, cluster, cand, m, precision=precision, order=order,
                           attention=attention, moe=moe)  # fmt: skip
    memory = planner_parts(mem)
    psi = float(mem.params_per_gpu)  # the charged rank's parameters per tp rank, before ZeRO

    model_flops = megatron_flops_per_iteration(global_batch, s, L, h, V, recompute=False)
    extra = moe_model_flops(cfg, moe, global_batch) if moe else 0.0  # top-k, not E, experts
    if efficiency is None:  # the card's roofline, overlap, bytes per the recipe (steptime.py)
        time = step_time(cfg, cluster, cand, m, params_per_gpu=psi, precision=precision,
                         attention=attention, order=order, bubble=bubble,
                         dp_collective=dp_collective,
                         dp_overlap=dp_overlap, tp_overlap=tp_overlap is True, moe=moe,
                         expert_params=mem.expert_params_per_gpu).terms  # fmt: skip
        if tp_overlap == "decomposed":  # re-price the blocks' tp term (tp_overlap.py)
            tp = decomposed_tp_comm(time["tp_comm"], L, h, s // cand.cp, cluster, cand, m)
            time = {**time, "tp_comm": tp}
        if dp_overlap and cand.zero == 3 and cand.pp == 1 and moe is None and (
                cand.cp, cand.ep, cand.shard_group) == (1, 1, "dp"):  # fmt: skip
            # FSDP's schedule: per-block rings, prefetch, per-step latency (zero3.py)
            z = zero3_schedule(cfg, cluster, cand, m, precision, order, attention)
            time = {**time, "dp_comm": z["gather"] + z["reduce_scatter"]}
    else:  # the old single constant, kept as the negative control (single_constant.py)
        time = single_constant_time(cfg, cluster, cand, m, psi=psi, efficiency=efficiency,
                                    bubble=bubble, order=order,
                                    dp_collective=dp_collective)  # fmt: skip
    total = sum(time.values())
    return Prediction(
        candidate=cand,
        memory=memory,
        time=time,
        micro_batches=m,
        fits=mem.total <= cluster.memory_bytes,
        mfu=(model_flops + extra) / (total * n * cluster.peak_flops),
        tokens_per_second=global_batch * s / total,
        capacity=cluster.memory_bytes,
        allowance=mem.allowance,
        host_bytes=mem.host_bytes,
        hfu=(hardware_flops(cfg, global_batch, cand.recompute)
             + extra * (4 / 3 if cand.recompute == "full" else 1))
        / (total * n * cluster.peak_flops),
    )


def plan(cfg: GPTConfig, cluster: Cluster, global_batch: int, **kwargs: object) -> list[Prediction]:
    """Predictions for every candidate in the planner's order of choice: fits with at least 5%
    of the card free first, then risky fits, then the rest; fastest first in each (ties: the
    smaller t x p). Its first element is "the planner's choice" wherever one is named."""
    if global_batch < 1:
        raise ValueError(f"global batch must be >= 1, got {global_batch}")
    efficiency = kwargs.pop("efficiency", None)  # None: the roofline (steptime.py)
    dp_overlap = bool(kwargs.pop("dp_overlap", False))  # dp reduce behind backward (steptime.py)
    tp_overlap = kwargs.pop("tp_overlap", False)  # False, True or "decomposed"
    precision = kwargs.pop("precision", MEGATRON_MIXED)
    bubble = str(kwargs.pop("bubble", "formula"))
    order = str(kwargs.pop("order", "tp-dp-pp"))
    dp_collective = str(kwargs.pop("dp_collective", "ring"))
    moe = kwargs.pop("moe", None)
    if moe is not None:
        kwargs.setdefault("n_experts", moe.n_experts)  # type: ignore[attr-defined]
    cands = enumerate_candidates(cfg, cluster, global_batch, **kwargs)  # type: ignore[arg-type]
    preds = [
        predict(
            cfg,
            cluster,
            global_batch,
            c,
            efficiency=None if efficiency is None else float(efficiency),  # type: ignore[arg-type]
            precision=precision,  # type: ignore[arg-type]
            bubble=bubble,
            order=order,
            dp_collective=dp_collective,
            dp_overlap=dp_overlap,
            # "decomposed" cuts SP's collectives: candidates without SP keep theirs exposed
            tp_overlap=tp_overlap if tp_overlap != "decomposed" or c.sp else False,  # type: ignore[arg-type]
            moe=moe,  # type: ignore[arg-type]
        )
        for c in cands
    ]
    return sorted(
        preds,
        key=lambda r: (not r.fits, r.risky, r.step_seconds, r.candidate.tp * r.candidate.pp),
    )
