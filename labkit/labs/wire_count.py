"""Counted messages of the 3D miniature against the planner's placement and bytes.

On every rank, :func:`count_layouts` trains a tiny GPT two steps under each layout of
:data:`LAYOUTS` with labkit's 3D composition (:mod:`labkit.parallel.threed`, the miniature of
lab 10) and :func:`count_zero` under each ZeRO stage of :data:`ZERO_RUNS` (data parallelism
alone), counting every message the rank sends (:class:`labkit.measure.wire_count.WireCounter`).
:func:`compare` and :func:`compare_zero` set the counts beside the planner's placement and
bytes (:mod:`labkit.measure.wire_tally`); ``python -m labkit.labs.wire_report`` launches it on
4 gloo ranks (2 nodes of 2: rank ``r`` on node ``r // 2``) and prints the tables.

Where the miniature and the planner differ by construction, :func:`compare` converts, in the
open: the miniature computes in fp32 (4-byte activations, the planner's are 16-bit: tp's
layers and ends, and pp's sends, x 2), and its pipeline sends the whole ``(b, s, h)``
activation from every tp rank (the planner prices Megatron's scatter/gather, ``1/t`` of it:
pp x t). The dp side and the tied embedding's gradient run fp32, the planner's
:data:`~labkit.memory.model.FP32_ADAM` precision: no conversion. Every parameter trains
(none frozen), so the planner's parameter count is the stage's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from labkit.collectives import Comm
from labkit.labs.mixed_links import ordered_layout
from labkit.measure.wire_count import WireCounter
from labkit.measure.wire_tally import (
    PRICED,
    Record,
    counted_placement,
    dp_bytes,
    p2p_pairs,
    planner_bytes,
    tally,
    term_of,
)
from labkit.memory.model import FP32_ADAM
from labkit.models.gpt import GPT, GPTConfig, lm_loss
from labkit.parallel.layout import ParallelDegrees
from labkit.parallel.threed import ThreeD, ThreeDConfig, build_threed
from labkit.planner.links import placement
from labkit.planner.space import Candidate
from labkit.zero.adam import AdamConfig
from labkit.zero.factory import make_optimizer

__all__ = [
    "LAYOUTS", "ZERO_RUNS", "WireConfig", "WireLayout", "compare", "compare_zero",
    "count_layouts", "count_zero",
]  # fmt: skip


@dataclass(frozen=True)
class WireLayout:
    """One layout of the miniature: degrees, rank order (innermost first), ZeRO stage."""

    name: str
    degrees: ParallelDegrees
    order: str = "tp-dp-pp"
    zero: str = "ddp"
    recompute: str = "none"  # or "full": every block's forward again in backward

    @property
    def candidate_zero(self) -> int:
        return {"ddp": 0, "zero1": 1}[self.zero]


LAYOUTS = (
    WireLayout("dp2 tp2", ParallelDegrees(dp=2, tp=2)),
    WireLayout("tp2 pp2", ParallelDegrees(tp=2, pp=2)),
    WireLayout("dp2 tp2, tp outermost", ParallelDegrees(dp=2, tp=2), order="dp-tp-pp"),
    WireLayout("dp2 tp2 zero1", ParallelDegrees(dp=2, tp=2), zero="zero1"),
    WireLayout("tp2 pp2 full recompute", ParallelDegrees(tp=2, pp=2), recompute="full"),
)


@dataclass(frozen=True)
class WireConfig:
    """The miniature: a tiny GPT (vocab and heads divisible by tp, layers by pp), ``steps``
    steps counted per layout, ``micro_batches`` of ``micro_batch`` sequences per replica."""

    model: GPTConfig = GPTConfig(vocab_size=64, block_size=8, n_layer=4, n_head=4, n_embd=32)
    layouts: tuple[WireLayout, ...] = LAYOUTS
    micro_batches: int = 2
    micro_batch: int = 2
    steps: int = 2
    gpus_per_node: int = 2
    seed: int = 0
    adam: AdamConfig = field(default_factory=AdamConfig)

    def threed(self, layout: WireLayout) -> ThreeDConfig:
        full = layout.recompute == "full"
        return ThreeDConfig(layout.degrees, self.micro_batches, self.micro_batch,
                            zero=layout.zero, checkpoint="full" if full else None)  # fmt: skip

    def zero_model(self, tied: bool) -> GPTConfig:
        """The data-parallel runs' GPT: two layers (ZeRO-3 issues a collective per module)."""
        return replace(self.model, n_layer=2, tie_weights=tied)

    def candidate(self, layout: WireLayout) -> Candidate:
        d = layout.degrees
        return Candidate(d.dp, d.tp, d.pp, self.micro_batch, layout.candidate_zero,
                         layout.recompute)  # fmt: skip


def comm_labels(job: ThreeD) -> dict[int, str]:
    """``{id(Comm): term}``: tensor-parallel blocks' Comms are "layers", the embedding's and
    head's "ends", the loss's "loss", the optimizer's "gradients"."""
    labels = {id(job.loss_comm): "loss", id(job.optimizer.comm): "gradients"}
    for chunk in job.chunks:
        for name, module in chunk.named_modules():
            for value in vars(module).values():
                if isinstance(value, Comm):
                    labels[id(value)] = "layers" if name.startswith("blocks") else "ends"
    return labels


def count_layouts(cfg: WireConfig) -> dict[str, Any]:
    """On every rank: per layout, this rank's records (message, term) of each step, its
    trainable parameters and pipeline rank."""
    out: dict[str, Any] = {"rank": dist.get_rank(), "layouts": {}}
    m, b, s = cfg.micro_batches, cfg.micro_batch, cfg.model.block_size
    for layout in cfg.layouts:
        torch.manual_seed(cfg.seed)
        gpt = GPT(cfg.model)
        job = build_threed(gpt, cfg.threed(layout), cfg.adam,
                           ordered_layout(layout.degrees, layout.order))  # fmt: skip
        labels = comm_labels(job)
        d = job.dp_rank
        steps: list[list[Record]] = []
        for step in range(cfg.steps):
            g = torch.Generator().manual_seed(1000 * cfg.seed + step)
            data = torch.randint(0, cfg.model.vocab_size, (layout.degrees.dp * m, b, s + 1),
                                 generator=g)  # fmt: skip
            x, y = data[d * m : (d + 1) * m, :, :-1], data[d * m : (d + 1) * m, :, 1:]
            with WireCounter() as wc:
                job.step(list(x), list(y))
            steps.append([(msg, term_of(msg, labels)) for msg in wc.messages])
        params = sum(p.numel() for p in job.stages.parameters() if p.requires_grad)
        out["layouts"][layout.name] = {"steps": steps, "params": params, "pp_rank": job.pp_rank}
        job.close()
    return out


# data parallelism alone over the world: (stage, tied embedding and head). ZeRO-1 runs in
# LAYOUTS, inside 3D; ZeRO-2 reduce-scatters every micro-batch, ZeRO-3 also gathers
ZERO_RUNS = (("zero2", True), ("zero3", True), ("zero3", False))


def count_zero(cfg: WireConfig) -> dict[tuple[str, bool], Any]:
    """On every rank: the GPT data-parallel over the world under each of :data:`ZERO_RUNS`
    (labkit's ZeRO, ``m`` micro-batches accumulated), its last step's records (ZeRO-3 runs
    two: the first carries its one-off lockstep check) and its trainable parameters."""
    out = {}
    m, b, s, world = cfg.micro_batches, cfg.micro_batch, cfg.model.block_size, dist.get_world_size()
    for stage, tied in ZERO_RUNS:
        torch.manual_seed(cfg.seed)
        model = GPT(cfg.zero_model(tied))
        psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
        opt = make_optimizer(stage, model, cfg.adam)
        labels = {id(opt.comm): "gradients"}
        for step in range(2 if stage == "zero3" else 1):
            g = torch.Generator().manual_seed(1000 * cfg.seed + step)
            data = torch.randint(0, cfg.model.vocab_size, (world * m, b, s + 1), generator=g)
            mine = data[dist.get_rank() * m : (dist.get_rank() + 1) * m]  # (m, b, s + 1)
            with WireCounter() as wc:
                opt.zero_grad()
                for x in mine:
                    (lm_loss(model(x[:, :-1]), x[:, 1:]) / m).backward()
                opt.step()
        out[(stage, tied)] = {"records": [(msg, term_of(msg, labels)) for msg in wc.messages],
                              "params": psi}  # fmt: skip
    return out


def compare_zero(cfg: WireConfig, run: dict[str, Any], stage: str, tied: bool,
                 world: int) -> dict[str, float]:  # fmt: skip
    """One rank's dp bytes under ``stage``: ``counted`` (the gradient and parameter
    collectives), ``planned`` (the planner's, for its own parameter count), ``formula`` (the
    planner's collectives at the model's real count, a tied ``V x h`` included),
    ``untied_formula`` (the same without the tied unit's extra ZeRO-3 gather: the old charge)
    and ``bookkeeping`` (the used flags)."""
    cand = Candidate(world, 1, 1, cfg.micro_batch, int(stage[-1]), "none")
    model = cfg.zero_model(tied)
    counts = tally(run["records"], cand.degrees, "tp-dp-pp", cfg.gpus_per_node)
    batch = world * cfg.micro_batches * cfg.micro_batch
    m, wte = cfg.micro_batches, model.vocab_size * model.n_embd if tied else 0.0
    return {
        "counted": sum(v for (a, t, _), v in counts.items() if (a, t) == ("dp", "gradients")),
        "planned": planner_bytes(model, cand, batch, FP32_ADAM)["gradients"],
        "formula": dp_bytes(cand, run["params"], FP32_ADAM, m, tied=wte),
        "untied_formula": dp_bytes(cand, run["params"], FP32_ADAM, m),
        "bookkeeping": sum(v for (a, t, _), v in counts.items() if t != "gradients"),
    }


def compare(cfg: WireConfig, results: list[dict[str, Any]], layout: WireLayout,
            step: int = -1, *, order: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Counted against planned for one layout (``order``: ask the planner about another rank
    order, a negative control). Per rank: ``counted`` (by ``(axis, term, link)``), ``planned``
    (``{term: bytes}`` the planner charges, activations converted to the miniature's fp32;
    "activations" per boundary, below) and ``dp_formula`` (the dp formula at this rank's own
    parameter count); per pipeline boundary: ``pp`` (counted both ways, planned); per axis:
    ``placement`` (counted, planned)."""
    deg, n = layout.degrees, cfg.gpus_per_node
    order = order or layout.order
    runs = [r["layouts"][layout.name] for r in results]
    records = [r["steps"][step] for r in runs]
    cand = cfg.candidate(layout)
    batch = deg.dp * cfg.micro_batches * cfg.micro_batch
    planned = planner_bytes(cfg.model, cand, batch, FP32_ADAM)
    act = 4 / 2  # the miniature's fp32 activations over the planner's 16-bit ones
    ranks = []
    for run, recs in zip(runs, records):
        ranks.append({
            "counted": tally(recs, deg, layout.order, n),
            "planned": {**planned, "layers": planned["layers"] * act,
                        "ends": planned["ends"] * act},
            "dp_formula": dp_bytes(cand, run["params"], FP32_ADAM, cfg.micro_batches),
            "pp_rank": run["pp_rank"],
        })  # fmt: skip
    pairs = p2p_pairs(records)
    boundaries = {tuple(sorted(k)): pairs.get(k, 0.0) + pairs.get(k[::-1], 0.0) for k in pairs}
    counted_place = counted_placement(records, deg, layout.order, n)
    planned_place = placement(n, deg.dp, deg.tp, deg.pp, order)
    return {
        "ranks": ranks,
        "pp": {k: (v, planned["activations"] * act * deg.tp) for k, v in boundaries.items()},
        "placement": {
            a: (counted_place.get(a), planned_place[a]) for a in PRICED if getattr(deg, a) > 1
        },
    }
