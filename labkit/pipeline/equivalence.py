"""The proof harness: the same GPT and micro-batches, trained by a pipeline schedule on ranks
and by single-process gradient accumulation; both return what the tests compare.

The spec: after every optimizer step, each pipeline rank's parameters equal the reference's
parameters of the same name (the tied head copy ``head.weight`` equals the reference's
``wte.weight``), and the first step's gradients and every step's loss agree, up to float
summation order. ``wpe.weight`` is frozen (``requires_grad=False``): it must never move and
must never get a gradient, on any rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from labkit.models.gpt import GPT, GPTConfig, lm_loss
from labkit.pipeline.actions import Schedule
from labkit.pipeline.executor import embedding_group, pipeline_step
from labkit.pipeline.stages import build_stages
from labkit.reference import grad_snapshot, snapshot
from labkit.reference import train_reference as _reference_loop

__all__ = [
    "PipeCase",
    "case_for",
    "check_cases",
    "micro_batches",
    "run_cases",
    "spec_case",
    "train_pipeline",
    "train_reference",
]

FROZEN = ("wpe.weight",)


@dataclass(frozen=True)
class PipeCase:
    """One run: the model, ``m`` micro-batches of ``batch`` sequences of ``seq`` tokens."""

    cfg: GPTConfig = GPTConfig(vocab_size=65, block_size=8, n_layer=4, n_head=2, n_embd=16)
    m: int = 4
    batch: int = 2
    seq: int = 8
    steps: int = 2
    lr: float = 0.1
    seed: int = 0
    stage_layers: tuple[int, ...] | None = None  # blocks per virtual stage (None: the default)


def micro_batches(case: PipeCase, step: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Token ids and next-token targets of step ``step``: m tensors of (batch, seq) each."""
    g = torch.Generator().manual_seed(1000 * case.seed + step)
    data = torch.randint(0, case.cfg.vocab_size, (case.m, case.batch, case.seq + 1), generator=g)
    return list(data[:, :, :-1]), list(data[:, :, 1:])


def _model(case: PipeCase) -> GPT:
    torch.manual_seed(case.seed)
    model = GPT(case.cfg)
    for name, prm in model.named_parameters():
        prm.requires_grad_(name not in FROZEN)
    return model


def train_reference(case: PipeCase) -> dict[str, Any]:
    """Single process: accumulate the m micro-batches' gradients, one SGD step, ``steps`` times."""
    model = _model(case)
    opt = torch.optim.SGD(
        [q for q in model.parameters() if q.requires_grad], lr=case.lr, momentum=0.9
    )
    per_step = [list(zip(*micro_batches(case, step))) for step in range(case.steps)]
    trace = _reference_loop(model, opt, per_step, lambda model, x, t: lm_loss(model(x), t))
    return {"losses": trace.losses, "grads": trace.first_grads, "params": trace.params}


def train_pipeline(
    sched: Schedule, case: PipeCase, group: dist.ProcessGroup | None = None, emb: Any = "new"
) -> dict[str, Any]:
    """On every pipeline rank (the same ``sched`` everywhere): this rank's chunks trained for
    ``case.steps`` steps. Returns losses (last-stage rank), first-step gradients and the
    parameters after every step by full-model name, the last step's measured timeline and
    peak stash. ``emb``: the embedding group (:func:`embedding_group`), made here if "new"."""
    rank = dist.get_rank(group)
    chunks = build_stages(_model(case), rank, sched.p, sched.v, case.stage_layers)
    named = [(n, q) for c in chunks for n, q in c.named_parameters()]
    opt = torch.optim.SGD([q for _, q in named if q.requires_grad], lr=case.lr, momentum=0.9)
    own = emb == "new"
    if own:
        emb = embedding_group(sched.p, sched.v, group)
    shape = (case.batch, case.seq, case.cfg.n_embd)
    losses, grads, params, res = [], {}, [], None
    for step in range(case.steps):
        opt.zero_grad(set_to_none=True)
        inputs, targets = micro_batches(case, step)
        res = pipeline_step(sched, chunks, inputs, targets, shape, group=group, emb_group=emb)
        losses.append(res.loss)
        if step == 0:
            grads = grad_snapshot(named)
        opt.step()
        params.append(snapshot(named))
    if own and emb is not None:
        dist.destroy_process_group(emb)
    assert res is not None
    return {
        "losses": losses,
        "grads": grads,
        "params": params,
        "timeline": res.timeline,
        "peak_stash": res.peak_stash,
    }


def case_for(p: int, m: int, **changes: Any) -> PipeCase:
    """The test model for p pipeline ranks: 2p layers, so interleaving with v = 2 divides;
    ``n_layer=`` another block count (an uneven cut when p x v does not divide it)."""
    base = PipeCase()
    n_layer = changes.pop("n_layer", 2 * p)
    return PipeCase(cfg=base.cfg.with_(n_layer=n_layer), m=m, **changes)


Spec = tuple[Any, ...]  # (schedule, m, v) or (schedule, m, v, n_layer, stage_layers or None)


def spec_case(spec: Spec, p: int) -> PipeCase:
    """The :class:`PipeCase` of one run spec (see :data:`Spec`)."""
    _, m, _, *cut = spec
    if not cut:
        return case_for(p, m)
    n_layer, layers = cut
    return case_for(p, m, n_layer=n_layer, stage_layers=None if layers is None else tuple(layers))


def run_cases(cases: list[Spec], p: int) -> list[dict[str, Any]]:
    """On each of p ranks: every (schedule, m, v[, n_layer, stage_layers]) of ``cases`` in
    turn (one launch for all)."""
    from labkit.pipeline.schedules import make_schedule

    emb = embedding_group(p, 1)  # every schedule here puts the last stage on rank p - 1
    out = [
        train_pipeline(make_schedule(spec[0], p, spec[1], spec[2]), spec_case(spec, p), emb=emb)
        for spec in cases
    ]
    if emb is not None:
        dist.destroy_process_group(emb)
    return out


def check_cases(cases: list[Spec], p: int) -> None:
    """Every case's model cut and schedule, checked before any process starts."""
    from labkit.pipeline.stages import check_pipeline

    for spec in cases:
        case = spec_case(spec, p)
        check_pipeline(case.cfg.n_layer, p, spec[1], spec[0], spec[2], case.stage_layers)
