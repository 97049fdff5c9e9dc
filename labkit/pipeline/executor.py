"""Run any valid schedule on real processes: each rank runs its action list, in order.

* F(mb, c): chunk c's forward on its input (tokens on the first stage, a received activation
  otherwise); the last stage's output is the loss ``lm_loss / m`` (gradient accumulation over
  the m micro-batches: the summed gradients are those of the mean loss).
* B(mb, c): backward from the output (or the loss) into the stage's input and, unless the
  schedule splits the backward, into the parameters.
* W(mb, c), split schedules only: the weight gradient (``weight_grad.py``): B runs
  ``autograd.grad(y, x)``, which skips the weight products, while hooks keep each Linear's and
  LayerNorm's input and output gradient; W computes ``g^T a`` and friends from them. The first
  stage (embedding; nobody waits for its input gradient) runs its whole backward in B.
* each run of sends/receives between two compute actions is ONE ``dist.batch_isend_irecv``,
  waited on as a whole: the NCCL-safe form the validator checks (gloo runs it too).
* off the happy path (:mod:`labkit.collectives.guard`): every rank first checks (cached) that
  all run one schedule with one activation shape and dtype; a stage that raises (F, B or W)
  puts its rank in send-only mode: it still posts every send (zeros) and receive of its list,
  so no peer waits forever, and at the end every rank raises, the group usable again.

The stash (a micro-batch's input and output kept from F to B, or W) is a dict; the measured
peak counts stashed outputs still alive through weak references, so a leak would show.
After the last action: the tied embedding's gradient is summed over the embedding group.
Every action's start and end are recorded (seconds since the step's starting barrier).
"""

from __future__ import annotations

import time
import weakref
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from labkit.collectives.guard import guarded, same_everywhere
from labkit.models.gpt import lm_loss
from labkit.parallel.layout import global_rank
from labkit.pipeline.actions import Action, Schedule
from labkit.pipeline.stages import StageModule, tied_pair
from labkit.pipeline.weight_grad import WeightGradRecorder, apply_weight_grads, splittable

__all__ = ["StepResult", "embedding_group", "embedding_groups", "pipeline_step"]


@dataclass
class StepResult:
    loss: float | None  # mean loss over the micro-batches, on the rank holding the last stage
    timeline: list[tuple[Action, float, float]] = field(default_factory=list)
    peak_stash: int = 0


def embedding_group(
    p: int, v: int = 1, group: dist.ProcessGroup | None = None
) -> dist.ProcessGroup | None:
    """The group of the two ranks holding the first and last stage of the pipeline ``group``
    (None when one rank holds both). For a job with ONE pipeline group; with several (dp or
    tp > 1), use :func:`embedding_groups`. Every rank of the world must call it."""
    return embedding_groups([[global_rank(group, i) for i in range(p)]], v)


def embedding_groups(pp_ranks: list[list[int]], v: int = 1) -> dist.ProcessGroup | None:
    """Megatron's embedding groups for every pipeline group (``rank_grid(degrees)["pp"]``:
    global ranks, in stage order); returns this rank's (None if it holds no tied copy, or
    one rank holds both). ``new_group`` is collective over the world, so every rank creates
    every pair, in the same order."""
    mine = None
    for ranks in pp_ranks:
        first, last = tied_pair(len(ranks), v)
        pair = sorted({ranks[first], ranks[last]})
        if len(pair) == 2:
            g = dist.new_group(pair)
            if dist.get_rank() in pair:
                mine = g
    return mine


def _reduce_tied(chunks: list[StageModule], emb_group: dist.ProcessGroup | None) -> None:
    """Sum the tied weight's two gradients (wte on the first stage, head on the last). With no
    group, one rank holds both uses in one Parameter: autograd already summed them."""
    if emb_group is None:
        return
    for c in chunks:
        if not c.tied:
            continue
        for w in ([c.wte.weight] if c.is_first else []) + ([c.head.weight] if c.is_last else []):
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            dist.all_reduce(w.grad, group=emb_group)


def pipeline_step(
    sched: Schedule,
    chunks: list[StageModule],
    inputs: list[torch.Tensor] | None,
    targets: list[torch.Tensor] | None,
    act_shape: tuple[int, ...],
    *,
    group: dist.ProcessGroup | None = None,
    emb_group: dist.ProcessGroup | None = None,
    dtype: torch.dtype = torch.float32,
    barrier: bool = True,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss,
) -> StepResult:
    """One training step's forward and backward on this pipeline rank (gradients accumulate in
    ``.grad``; the caller steps the optimizer). ``inputs``/``targets``: the m micro-batches
    of tokens (B, T), needed on the first/last stage's rank. ``act_shape``: (B, T, d), the
    shape of every activation and gradient that crosses ranks. ``loss_fn(output, targets)``:
    the last stage's loss (a vocab-parallel one when the head is tensor-parallel)."""
    rank = dist.get_rank(group)
    device = next(chunks[0].parameters()).device
    _agree(sched, act_shape, dtype, group, device)
    last_stage = sched.num_stages - 1
    stash: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (mb, chunk) -> (x, y)
    # split schedules: W's inputs and output gradients, recorded during F and B
    recorders = [
        WeightGradRecorder(c) if sched.split_backward and not c.is_first and splittable(c) else None
        for c in chunks
    ]
    recorded: dict[tuple[int, int], list] = {}
    alive: list[weakref.ref] = []
    received: dict[tuple[str, int, int], torch.Tensor] = {}
    grads_out: dict[tuple[int, int], torch.Tensor] = {}  # input gradients to send back
    local: dict[tuple[str, int, int], torch.Tensor] = {}  # hand-offs between chunks of a rank
    batch: list[Action] = []
    result = StepResult(loss=None)
    loss_sum = 0.0
    if barrier:  # align the ranks' clocks for the timeline (off: nothing waits for it)
        dist.barrier(group=group)
    t0 = time.perf_counter()

    def zeros() -> torch.Tensor:
        return torch.zeros(act_shape, dtype=dtype, device=device)

    def flush() -> None:
        if not batch:
            return
        start = time.perf_counter() - t0
        ops, bufs = [], []
        for a in batch:
            peer = global_rank(group, a.peer)  # type: ignore[arg-type]
            if a.kind == "SEND_F":  # (after a failed compute, send-only mode sends zeros)
                y = stash[(a.mb, a.chunk)][1] if (a.mb, a.chunk) in stash else zeros()
                ops.append(dist.P2POp(dist.isend, y.detach(), peer))
            elif a.kind == "SEND_B":
                ops.append(dist.P2POp(dist.isend, grads_out.pop((a.mb, a.chunk), zeros()), peer))
            else:
                buf = torch.empty(act_shape, dtype=dtype, device=device)
                ops.append(dist.P2POp(dist.irecv, buf, peer))
                bufs.append((a, buf))
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        for a, buf in bufs:
            received[(a.kind, a.mb, a.chunk)] = buf
        end = time.perf_counter() - t0
        result.timeline += [(a, start, end) for a in batch]
        batch.clear()

    def compute(a: Action) -> None:
        nonlocal loss_sum
        chunk = chunks[a.chunk]
        s = sched.stage(rank, a.chunk)
        start = time.perf_counter() - t0
        if a.kind == "F":
            if s == 0:
                x = inputs[a.mb]  # type: ignore[index]
            else:
                x = received.pop(("RECV_F", a.mb, a.chunk), None)
                if x is None:
                    x = local.pop(("F", a.mb, a.chunk - 1))
                x.requires_grad_(True)
            rec = recorders[a.chunk]
            if rec is not None:
                with rec.record() as entries:
                    y = chunk(x)
                recorded[(a.mb, a.chunk)] = entries
            else:
                y = chunk(x)
            if s == last_stage:
                y = loss_fn(y, targets[a.mb]) / sched.m  # type: ignore[index]
                loss_sum += y.item() * sched.m
            elif sched.place(s + 1)[0] == rank:
                local[("F", a.mb, a.chunk + 1)] = y.detach()
            stash[(a.mb, a.chunk)] = (x, y)
            alive.append(weakref.ref(y))
            result.peak_stash = max(result.peak_stash, sum(r() is not None for r in alive))
        elif a.kind == "B":
            x, y = stash[(a.mb, a.chunk)]
            if s == last_stage:
                dy = None
            else:
                dy = received.pop(("RECV_B", a.mb, a.chunk), None)
                if dy is None:
                    dy = local.pop(("B", a.mb, a.chunk + 1))
            grad_x: torch.Tensor | None = None
            if recorders[a.chunk] is not None:  # B: input gradient only, weights wait for W
                (grad_x,) = torch.autograd.grad(y, x, dy)
            else:  # the whole backward (a stage that cannot or need not split: W is empty)
                torch.autograd.backward(y, dy)
                grad_x = x.grad if s > 0 else None
            if not sched.split_backward:
                del stash[(a.mb, a.chunk)]
            if s > 0:
                assert grad_x is not None
                _hand_back(sched, rank, s, a, grad_x, grads_out, local)
        else:  # W
            x, y = stash.pop((a.mb, a.chunk))
            apply_weight_grads(recorded.pop((a.mb, a.chunk), []))
        del x, y
        result.timeline.append((a, start, time.perf_counter() - t0))

    with guarded("pipeline_step", group, device) as g:
        for a in sched.ranks[rank]:
            if not a.is_compute:
                batch.append(a)
                continue
            flush()
            g.run(compute, a)  # if a stage raises: its rank goes on with the messages, zeros
        flush()
        for rec in recorders:
            if rec is not None:
                rec.close()
        _reduce_tied(chunks, emb_group)
    if any(c.is_last for c in chunks):
        result.loss = loss_sum / sched.m
    return result


def _agree(
    sched: Schedule, act_shape: tuple[int, ...], dtype: torch.dtype, group: Any, device: Any
) -> None:
    """The same ValueError on every rank unless every rank of ``group`` runs this schedule with
    one activation shape and dtype: a rank receiving (2, 8, 16) from one sending (3, 8, 16)
    would abort gloo. Cached (:func:`labkit.collectives.guard.same_everywhere`): once per
    combination, so a training loop pays it at its first step."""
    p = dist.get_world_size(group)
    problem = None if p == sched.p else f"the schedule has p={sched.p}, the group {p} ranks"
    act = torch.empty_strided(act_shape, [0] * len(act_shape), dtype=dtype, device=device)
    digest = zlib.crc32(repr((sched.name, sched.split_backward, sched.ranks)).encode())
    fields = {"schedule (crc32 of its actions)": digest, "m": sched.m, "v": sched.v}
    same_everywhere("pipeline_step", group, {"activation": act}, fields, problem=problem)


def _hand_back(
    sched: Schedule, rank: int, s: int, a: Action, dx: torch.Tensor, grads_out: dict, local: dict
) -> None:
    """Queue stage s's input gradient for the previous stage: a send, or a local hand-off."""
    if sched.place(s - 1)[0] == rank:
        local[("B", a.mb, a.chunk - 1)] = dx
    else:
        grads_out[(a.mb, a.chunk)] = dx
