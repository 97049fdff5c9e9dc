"""One configuration of the composition matrix on its ranks (dp x cp = 2, x tp x pp), trained
for two steps; its single-process reference is :mod:`labkit.parallel.composed_ref`.

The composition order is :func:`labkit.parallel.compose`'s (experts lifted -> tp -> ep -> cp
-> activation checkpointing -> pipeline -> data parallelism), and the pipeline cut is 3D's
(:func:`~labkit.parallel.threed.pipeline_hook`), used for pp = 1 too (one stage holding
everything); MoE layers become expert-parallel over ep and attention context-parallel over
cp inside compose (:mod:`labkit.parallel.cp_ep`), each cp rank feeding its chunks of the
sequence. Data
parallelism, over ``dp_cp_group`` (dense gradients average over every rank whose tokens the
loss counts), is one of:

* a DDP wrapper (naive, flat, bucketed, overlapped) around this rank's stages, with torch's
  AdamW on its parameters: micro-batches accumulate inside ``no_sync()``; with pp = 1 the last
  micro-batch's backward runs with sync on (overlapped DDP launches its buckets from gradient
  hooks, while tensor parallelism's collectives run on the main thread); with pp = 2 the
  executor's whole step is one ``no_sync()`` and ``finish_gradient_sync()`` follows it;
* a ZeRO stage (``labkit.zero.make_optimizer``), its own dp reduction at ``step`` (stages
  0-1) or during backward (2-3; pp = 1 only, see :data:`labkit.parallel.matrix.REFUSED`).

Then, in this order (all linear, so any order gives the same sum, but each needs the
gradients where they are at that moment): sequence-parallel parameters' partial gradients are
summed over tp (after the wrapper's dp average, or on ZeRO-2/3's gradient shard, whose layout
is the same on every tp rank); the tied embedding's two gradients are summed over Megatron's
embedding group (pp = 2); the optimizer steps (fp16: through the loss scaler, which agrees on
a skipped step over the whole world, since tp and pp ranks hold different gradients).
At ep = 2 the dp wrapper is built without the experts (:func:`~labkit.parallel.cp_ep.
hidden_experts`); their gradients are summed over ``edp_group`` and divided by dp x cp after
the wrapper's sync.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from labkit.collectives import Comm
from labkit.ddp import BucketedDDP, FlatDDP, NaiveDDP, OverlappedDDP
from labkit.models.gpt import lm_loss
from labkit.parallel.compose import compose
from labkit.parallel.composed_ref import (
    ADAM,
    INIT_SCALE,
    MICRO_BATCH,
    SEQ,
    STEPS,
    ScaleGrad,
    add_branch,
    autocast,
    batch,
    build_model,
    model_config,
)
from labkit.parallel.composed_sync import dp_mean, snapshot, sum_sequence_parallel
from labkit.parallel.cp_ep import (
    expert_modules,
    hidden_experts,
    reduce_expert_grads,
    split_sequence,
)
from labkit.parallel.layout import ParallelDegrees, build_layout, rank_grid
from labkit.parallel.matrix import Combo, check_combo
from labkit.parallel.threed import pipeline_hook, sum_tied_grads
from labkit.pipeline.executor import embedding_groups, pipeline_step
from labkit.pipeline.schedules import make_schedule
from labkit.pipeline.stages import check_pipeline
from labkit.precision.loss_scaler import DynamicLossScaler
from labkit.tensor_parallel import TPConfig, vocab_parallel_cross_entropy
from labkit.zero.factory import make_optimizer

__all__ = ["WRAPPERS", "check", "degrees", "train_combo", "train_combos"]

WRAPPERS = {
    "naive": NaiveDDP,
    "flat": FlatDDP,
    "bucketed": BucketedDDP,
    "overlapped": OverlappedDDP,
    "overlapped+views": partial(OverlappedDDP, grad_as_bucket_view=True),
}
BUCKET_MB = 0.004  # ~4 KB: several buckets even for the tiny GPT
SCHEDULE = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved", "zbh1": "zb-h1"}


def degrees(combo: Combo) -> ParallelDegrees:
    cp = combo.cp_degree
    return ParallelDegrees(
        dp=2 // cp, tp=combo.tp_degree, pp=combo.pp_degree, cp=cp, ep=combo.ep_degree
    )


def _virtual(combo: Combo) -> int:
    return 2 if combo.pp == "interleaved" else 1


def check(combo: Combo) -> None:
    """Every reason ``combo`` cannot run, as a ValueError, before any process starts: a
    refused pair (:func:`~labkit.parallel.matrix.check_combo`), the model's shape against tp,
    the cut and schedule against pp."""
    check_combo(combo)
    d, cfg = degrees(combo), model_config(combo)
    d.check_model(hidden=cfg.n_embd, heads=cfg.n_head, vocab=cfg.vocab_size, seq=SEQ)
    if combo.pp != "1":
        check_pipeline(cfg.n_layer, d.pp, combo.accum, SCHEDULE[combo.pp], _virtual(combo))


def train_combos(
    combos: list[Combo], wrong: list[str | None] | None = None
) -> list[dict[str, Any]]:
    """On every rank of a world of the combos' size: each combo in turn (``wrong[i]``: the
    negative control of combo i, see :func:`train_combo`). A failure is recorded and the next
    combo runs; one that raised on some ranks only leaves the others in a collective, and the
    caller's timeout reports every rank's stack."""
    out = []
    for i, c in enumerate(combos):
        start = time.perf_counter()
        try:
            out.append(train_combo(c, None if wrong is None else wrong[i]))
        except Exception as exc:  # noqa: BLE001 - reported per configuration, by name
            out.append({"rank": dist.get_rank(), "error": f"{type(exc).__name__}: {exc}"})
        out[-1]["seconds"] = time.perf_counter() - start
    return out


def _cut(model: Any, pp_group: Any, *, combo: Combo) -> Any:
    """The pipeline hook: the branch joins the (tensor-parallel) GPT, then 3D's cut."""
    if combo.branch:
        add_branch(getattr(model, "gpt", model), combo.sequence_parallel)
    return pipeline_hook(model, pp_group, virtual=_virtual(combo))


def train_combo(combo: Combo, wrong: str | None = None) -> dict[str, Any]:
    """Train ``combo`` for STEPS steps on this rank. Returns ``rank``, ``losses`` (the dp mean,
    None off the last stage) and ``params`` (after each step, full size, named as the
    reference; on tp rank 0 of each replica, ZeRO-3: of replica 0; else []). Negative
    controls: ``wrong="no_dp_sync"`` skips the wrapper's gradient average; ``"dp_only"``
    averages dense gradients over dp only, not dp x cp; ``"gates_reversed"`` misroutes (see
    :func:`_reverse_gates`)."""
    check(combo)
    d = degrees(combo)
    layout = build_layout(d)
    tpc = None
    if combo.tp != "1":
        tpc = TPConfig(sequence_parallel=combo.sequence_parallel, impl=combo.tp_comm,
                       overlap=combo.tp == "2+osp")  # fmt: skip
    stages: Any = compose(
        build_model(combo, branch=False), layout, tensor_parallel=tpc,
        experts=combo.ep != "0", context_parallel=combo.cp_attention, seq=SEQ,
        checkpoint="full" if combo.checkpoint else None, pipeline=partial(_cut, combo=combo),
    )  # fmt: skip
    if wrong == "gates_reversed":
        _reverse_gates(stages)
    chunks = list(stages.chunks)
    model = chunks[0] if combo.pp == "1" else stages  # ZeRO-3's hooks need the forward's module
    scaler = DynamicLossScaler(INIT_SCALE) if combo.precision == "fp16" else None
    trainable = [p for p in stages.parameters() if p.requires_grad]
    ddp: Any = None
    opt: Any = None
    dense: Any = layout.dp_group if wrong == "dp_only" else layout.dp_cp_group
    if combo.dp in WRAPPERS:
        comm = Comm(dense, combo.dp_comm)
        extra: dict[str, Any] = {}
        if combo.dp.startswith(("bucketed", "overlapped")):
            extra["bucket_cap_mb"] = BUCKET_MB
        wrapper: Any = WRAPPERS[combo.dp]
        with hidden_experts(stages) if combo.ep == "2" else contextlib.nullcontext():
            ddp = wrapper(model, group=dense, comm=comm, **extra)
        a = ADAM
        opt = torch.optim.AdamW(
            trainable, lr=a.lr, betas=a.betas, eps=a.eps, weight_decay=a.weight_decay
        )
    else:
        stage = combo.dp.split("+")[0]
        opt = make_optimizer(
            stage, model, ADAM, group=dense, comm_impl=combo.dp_comm, scaler=scaler,
            prefetch=combo.dp.endswith("prefetch"),
        )  # fmt: skip
    tied = combo.tied and combo.pp != "1"
    emb_group = embedding_groups(rank_grid(d)["pp"], _virtual(combo)) if tied else None
    tp_comm = Comm(layout.tp_group, combo.tp_comm)
    m, dp_rank, cp = combo.accum, layout.dp_rank, combo.cp_degree
    try:
        losses, params = [], []
        for step in range(STEPS):
            x, y = batch(combo, step)
            xs, ys = (
                list(x[dp_rank * m : (dp_rank + 1) * m]),
                list(y[dp_rank * m : (dp_rank + 1) * m]),
            )
            if combo.cp_attention is not None:  # (B, T) -> (B, T/cp): this cp rank's chunks
                split = partial(
                    split_sequence, cp=cp, rank=layout.cp_rank, attention=combo.cp_attention
                )
                xs, ys = [split(t) for t in xs], [split(t) for t in ys]
            if ddp is not None:
                opt.zero_grad(set_to_none=True)
            else:
                opt.zero_grad()
            loss = _forward_backward(combo, chunks, layout, ddp, xs, ys, tp_comm, scaler)
            if ddp is not None and wrong != "no_dp_sync":
                ddp.finish_gradient_sync()
            if combo.ep == "2":
                reduce_expert_grads(stages, layout.edp_group, 2)  # / (dp x cp)
            if combo.sequence_parallel:
                sum_sequence_parallel(
                    stages, opt, tp_comm, sharded=combo.dp.startswith(("zero2", "zero3"))
                )
            sum_tied_grads(chunks, emb_group)
            if ddp is None or scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            losses.append(dp_mean(loss, layout))
            params.append(snapshot(combo, stages, model, opt, layout))
        return {"rank": dist.get_rank(), "losses": losses, "params": [p for p in params if p]}
    finally:  # this configuration's groups go with it (the next builds its own)
        groups = [emb_group, layout.tp_group, layout.dp_group, layout.pp_group, layout.cp_group]
        groups += [layout.dp_cp_group, layout.ep_group, layout.edp_group]
        for g in {id(g): g for g in groups if g is not None}.values():
            if g is not dist.group.WORLD:
                dist.destroy_process_group(g)


def _reverse_gates(stages: Any) -> None:
    """Every router hands its gates back in reverse choice order: choice c's expert weighted by
    choice k-1-c's gate (a gather with the wrong index), a misrouting the check must catch."""

    def hook(module: Any, args: Any, routing: Any) -> Any:
        return dataclasses.replace(routing, gates=routing.gates.flip(-1))  # (n, k)

    for m in expert_modules(stages):
        m.router.register_forward_hook(hook)


def _forward_backward(
    combo: Combo, chunks: list[Any], layout: Any, ddp: Any, xs: list, ys: list,
    tp_comm: Comm, scaler: DynamicLossScaler | None,
) -> float | None:  # fmt: skip
    """This rank's forward and backward of its micro-batches; the last stage's mean loss."""
    scale = 1.0 if scaler is None else scaler.get_scale()

    def loss_fn(logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        logits = logits.float()  # cross-entropy in fp32, as autocast runs F.cross_entropy
        loss = lm_loss(logits, tgt) if combo.tp == "1" else vocab_parallel_cross_entropy(
            logits, tgt, tp_comm
        )  # fmt: skip
        return loss if scale == 1.0 else ScaleGrad.apply(loss, scale)

    m = len(xs)
    if combo.pp == "1":
        total = 0.0
        for i, (xi, yi) in enumerate(zip(xs, ys)):
            quiet = ddp.no_sync() if ddp is not None and i < m - 1 else contextlib.nullcontext()
            with quiet:
                with autocast(combo):
                    loss = loss_fn(chunks[0](xi), yi) / m
                loss.backward()
            total += loss.item()
        return total
    sched = make_schedule(SCHEDULE[combo.pp], 2, m, _virtual(combo))
    t = combo.tp_degree if combo.sequence_parallel else 1
    shape = (MICRO_BATCH, xs[0].shape[1] // t, model_config(combo).n_embd)  # xs: (B, T/cp)
    quiet = ddp.no_sync() if ddp is not None else contextlib.nullcontext()
    with quiet, autocast(combo):
        res = pipeline_step(
            sched, chunks, xs, ys, shape, group=layout.pp_group, loss_fn=loss_fn, barrier=False
        )
    return res.loss
