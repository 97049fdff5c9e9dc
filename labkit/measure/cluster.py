"""Measured on the emulated cluster: all-reduce busbw, DDP step time, strong scaling (S4, A4).

Everything here runs inside ``labkit.launch(..., cluster=EmulatedCluster(...))`` ranks (the
``*_worker`` functions) or launches them (``measure_*``; ``cluster_section.py`` runs notebook
09's section 3 in one launch). The node layout is passed explicitly (``ranks_per_node``).

* **busbw** (nccl-tests' definition, :func:`labkit.collectives.cost_model.busbw_factor`):
  labkit's flat all-reduce (``Comm(impl="ring")``), the hierarchical one
  (``Comm(impl="hierarchical")``) and torch's ``dist.all_reduce``, interleaved step by step
  after a warm-up; medians of rank 0's clock, each call closed by a barrier.
* **DDP step** of the tiny BERT with :class:`labkit.ddp.OverlappedDDP` over each ``Comm``
  impl, with and without compression; the variants are interleaved step by step. Exposed
  communication is the time spent in ``finish_gradient_sync()`` (what is left of the
  all-reduces after backward); its share of the step is the number A4 starts from.
  With ``profile=``, the same launch also profiles one variant's steps with
  :mod:`labkit.profiling.breakdown` (A1's per-rank view: data, forward, backward, exposed
  comm, optimizer).
* **strong scaling**: the same global batch on 1, 2 and 4 nodes, in ONE launch on the largest
  cluster: for each n the ranks of the first n nodes form a group and train while the others
  wait; the n's are interleaved step by step (each launch of a fresh world costs seconds of
  process start-up, more than the steps themselves).

The communication side (:func:`make_comm`, busbw) is in ``cluster_comm.py``, re-exported here.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from labkit.ddp.compression import make_compression
from labkit.labs.bert4nodes import sentence_task
from labkit.measure.cluster_comm import COMMS, _launch, busbw_worker, make_comm, measure_busbw
from labkit.measure.cluster_profile import _profiled_steps
from labkit.measure.timing import interleaved_times
from labkit.models.bert import Bert, BertConfig, bert_loss, bert_preset

__all__ = [
    "COMMS",
    "DEFAULT_VARIANTS",
    "Variant",
    "busbw_worker",
    "ddp_worker",
    "make_comm",
    "measure_busbw",
    "measure_ddp",
    "measure_strong_scaling",
]


# ------------------------------------------------------------------------------ DDP step
@dataclass(frozen=True)
class Variant:
    """One way to synchronise the gradients: the ``Comm`` impl, the compression, the wrapper
    (``"overlapped"``: all-reduces from gradient hooks; ``"bucketed"``: after backward) and
    the bucket cap. ``impl="local"`` is no DDP at all: the compute alone."""

    impl: str = "torch"
    compression: str = "none"
    wrapper: str = "overlapped"
    bucket_cap_mb: float = 0.25

    def __post_init__(self) -> None:
        if self.impl not in (*COMMS, "local"):
            raise ValueError(f"impl={self.impl!r}: expected one of {(*COMMS, 'local')}")
        if self.wrapper not in ("overlapped", "bucketed"):
            raise ValueError(f"wrapper={self.wrapper!r}: expected 'overlapped' or 'bucketed'")
        make_compression(self.compression)  # a bad name is refused here, before any launch
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb={self.bucket_cap_mb} must be > 0")

    @property
    def name(self) -> str:
        if self.impl == "local":
            return "no DDP (compute)"
        parts = [self.impl, self.compression if self.compression != "none" else ""]
        parts += [f"{self.wrapper} {self.bucket_cap_mb:g} MB"]
        return " + ".join(p for p in parts if p)


DEFAULT_VARIANTS = (
    Variant("local"),
    Variant("torch"),
    Variant("ring"),
    Variant("hierarchical"),
    Variant("hierarchical", "fp16"),
    Variant("hierarchical", "powersgd2"),
)


def _wrap(net: torch.nn.Module, v: Variant, ranks_per_node: int, group: Any = None) -> Any:
    from labkit.ddp import BucketedDDP, OverlappedDDP

    if v.impl == "local":
        return net
    # compressed gradients travel in their own 16-bit dtype (wire="input"): fewer bytes is
    # their whole point; labkit's default moves 16-bit partial sums as float32
    wire = "accum" if v.compression == "none" else "input"
    kwargs: dict[str, Any] = {"comm": make_comm(v.impl, ranks_per_node, wire, group)}
    if v.compression != "none":
        kwargs["compression"] = make_compression(v.compression)
    cls = OverlappedDDP if v.wrapper == "overlapped" else BucketedDDP
    return cls(net, bucket_cap_mb=v.bucket_cap_mb, **kwargs)


def _stepper(
    cfg: BertConfig, v: Variant, rpn: int, task: Any, per_rank: int, g: torch.Generator,
    group: Any = None,
) -> tuple[Any, tuple[Any, Any], list[float]]:
    """One variant's own model, optimizer and wrapper over ``group``: ``(step, (model, opt),
    exposed)``; each ``step()`` appends the seconds ``finish_gradient_sync()`` waited."""
    torch.manual_seed(0)
    net = Bert(cfg)
    model, opt = _wrap(net, v, rpn, group), torch.optim.AdamW(net.parameters())
    exposed: list[float] = []

    def step() -> None:
        idx = torch.randint(0, len(task), (per_rank,), generator=g)
        bert_loss(model, *task.batch(idx)).backward()
        t0 = time.perf_counter()
        if hasattr(model, "finish_gradient_sync"):
            model.finish_gradient_sync()  # waits for what backward did not hide
        exposed.append(time.perf_counter() - t0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, (model, opt), exposed


def _row(stepper: Any, times: list[float], warmup: int, steps: int) -> dict[str, float]:
    """Median step and exposed seconds, and the bytes this rank's ``Comm`` counted per step."""
    _, (model, _), exposed = stepper
    sent = model.comm.total_sent / (warmup + steps) if hasattr(model, "comm") else 0.0
    return {
        "step": statistics.median(times),
        "exposed_comm": statistics.median(exposed[warmup:]),
        "sent": sent,
    }


def ddp_worker(
    cfg: BertConfig,
    variants: Sequence[Variant],
    global_batch: int,
    ranks_per_node: int,
    steps: int,
    warmup: int,
    profile: Variant | None = None,
) -> dict[str, Any]:
    """On every rank: ``{variant name: {"step", "exposed_comm", "sent"}}`` (median seconds;
    bytes this rank's ``Comm`` counted per step). Each variant is its own model, optimizer
    and wrapper; the variants' steps are interleaved. With ``profile`` (one of ``variants``),
    ``"profile"`` holds that variant's profiled per-rank breakdown (``Breakdown.as_dict()``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    task = sentence_task("train", cfg.max_position)
    per_rank = global_batch // world
    g = torch.Generator().manual_seed(rank)
    steppers = {v.name: _stepper(cfg, v, ranks_per_node, task, per_rank, g) for v in variants}
    times = interleaved_times({n: s[0] for n, s in steppers.items()}, steps, warmup,
                              sync=dist.barrier)  # fmt: skip
    out: dict[str, Any] = {n: _row(steppers[n], t, warmup, steps) for n, t in times.items()}
    if profile is not None:  # A1: the per-rank breakdown of one variant, after the timing
        out["profile"] = _profiled_steps(steppers[profile.name][1], task, per_rank, g, steps)
    return out


def measure_ddp(
    cluster: Any,
    world_size: int,
    variants: Sequence[Variant] = DEFAULT_VARIANTS,
    *,
    cfg: BertConfig | None = None,
    global_batch: int = 32,
    steps: int = 5,
    warmup: int = 2,
    profile: Variant | None = None,
    timeout: float = 300,
) -> dict[str, Any]:
    """DDP step time of the tiny BERT per variant (rank 0's medians) and the comm share;
    with ``profile``, ``"profile"`` is every rank's breakdown of that variant."""
    cfg = cfg or bert_preset("lab")
    rpn = _check_ddp(cluster, world_size, variants, global_batch, profile)
    ranks = _launch(
        ddp_worker, cfg, list(variants), global_batch, rpn, steps, warmup, profile,
        world_size=world_size, cluster=cluster, timeout=timeout,
    )  # fmt: skip
    return _ddp_result(ranks, cluster.resolved_mode(), rpn, profile is not None)


def _check_ddp(cluster: Any, world: int, variants: Any, batch: int, profile: Any) -> int:
    """ValueError for what :func:`measure_ddp` cannot run, before any process; the rpn."""
    if batch % world:
        raise ValueError(f"global_batch={batch} is not divisible by world_size={world}")
    if profile is not None and (profile not in variants or profile.impl == "local"):
        raise ValueError(f"profile={profile} must be one of the variants, and a DDP one")
    return int(cluster.topology(world).ranks_per_node)


def _ddp_result(ranks: list[Any], mode: str, rpn: int, profiled: bool) -> dict[str, Any]:
    """:func:`measure_ddp`'s answer from every rank's :func:`ddp_worker` result."""
    res = {k: v for k, v in ranks[0].items() if k != "profile"}
    for row in res.values():
        row["comm_share"] = row["exposed_comm"] / row["step"]
    out = {"steps": res, "mode": mode, "rpn": rpn}
    if profiled:
        from labkit.profiling.breakdown import Breakdown

        out["profile"] = [Breakdown.from_dict(r["profile"]) for r in ranks]
    return out


# ------------------------------------------------------------------------------ scaling
def scaling_worker(
    cfg: BertConfig, nodes: Sequence[int], global_batch: int, ranks_per_node: int, impl: str,
    steps: int, warmup: int,
) -> dict[int, dict[str, float]]:
    """On every rank of the largest cluster: for each ``n`` in ``nodes``, the ranks of the
    first ``n`` nodes form a group and step the tiny BERT on ``global_batch`` split over them
    (``"torch"`` DDP on one rank, ``impl`` otherwise); the others skip that turn. The ``n``'s
    are interleaved step by step, every turn opened and closed by a barrier of the whole job.
    Returns ``{n: {"step", "exposed_comm", "sent"}}`` for this rank's groups (rank 0: all)."""
    rank = dist.get_rank()
    task = sentence_task("train", cfg.max_position)
    g = torch.Generator().manual_seed(rank)
    steppers = {}
    for n in nodes:
        world = n * ranks_per_node
        group = dist.new_group(list(range(world)))  # every rank takes part in every new_group
        if rank < world:
            v = Variant("torch" if world == 1 else impl, bucket_cap_mb=1.0)
            steppers[n] = _stepper(cfg, v, ranks_per_node, task, global_batch // world, g, group)
    fns = {str(n): steppers[n][0] if n in steppers else (lambda: None) for n in nodes}
    times = interleaved_times(fns, steps, warmup, sync=dist.barrier)
    return {n: _row(s, times[str(n)], warmup, steps) for n, s in steppers.items()}


def measure_strong_scaling(
    make_cluster: Any,
    nodes: Sequence[int] = (1, 2, 4),
    *,
    ranks_per_node: int = 1,
    impl: str = "ring",
    cfg: BertConfig | None = None,
    global_batch: int = 32,
    steps: int = 4,
    warmup: int = 1,
    timeout: float = 300,
) -> dict[int, dict[str, float]]:
    """``{N: {"step", "exposed_comm", "speedup", "efficiency"}}`` at a fixed global batch.

    One launch (:func:`scaling_worker`) on ``make_cluster(max(nodes))`` (``None``: a plain
    launch). ``impl``: ``"torch"`` or ``"ring"``; ``"hierarchical"`` spans the whole world, but
    with one rank per node it is its phase 2 alone, labkit's all-reduce: it runs as "ring".
    """
    cfg = cfg or bert_preset("lab")
    bad = [n for n in nodes if global_batch % (n * ranks_per_node)]
    if bad or 1 not in nodes:
        raise ValueError(
            f"need 1 in nodes and global_batch={global_batch} divisible by every world size; "
            f"nodes={tuple(nodes)}, ranks_per_node={ranks_per_node}"
        )
    if impl not in COMMS or (impl == "hierarchical" and ranks_per_node > 1):
        raise ValueError(
            f"impl={impl!r} with ranks_per_node={ranks_per_node}: expected 'torch' or 'ring' "
            f"('hierarchical' only with one rank per node, where it is 'ring')"
        )
    top = max(nodes)
    res = _launch(
        scaling_worker, cfg, sorted(set(nodes)), global_batch, ranks_per_node,
        "ring" if impl == "hierarchical" else impl, steps, warmup,
        world_size=top * ranks_per_node, cluster=make_cluster(top), timeout=timeout,
    )[0]  # fmt: skip
    out = {n: dict(res[n]) for n in sorted(res)}
    for n, row in out.items():
        row["speedup"] = out[1]["step"] / row["step"]
        row["efficiency"] = row["speedup"] / n
    return out
