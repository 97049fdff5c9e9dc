"""3D parallelism: data x tensor x pipeline (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM"), built from labkit's pieces.

Each rank holds ONE tensor-parallel shard of ONE pipeline stage of ONE data-parallel replica:

* the full GPT is built on every rank from one seed; ``compose`` (the one place the order is
  written) makes it tensor-parallel over ``layout.tp_group``, cuts this rank's stage out of
  it over ``layout.pp_group`` (:func:`pipeline_hook`), and gives what is left to an AdamW that
  averages (``"ddp"``) or reduce-scatters (``"zero1"``) gradients over ``layout.dp_group``
  only (:func:`data_parallel_hook`);
* one step (:meth:`ThreeD.step`): the pipeline executor runs the schedule over the m
  micro-batches of this replica (activations (b, T, d) cross the pp group; the last stage's
  loss is the vocab-parallel cross-entropy over the tp group), then the tied embedding's two
  gradients (first and last stage, same tp index) are summed over the embedding group, then
  the optimizer averages over dp.

The arithmetic that makes it equal single-process training: replica d takes micro-batches
``[d m, (d + 1) m)`` of the global batch, each loss divided by m; the dp average divides by
dp, so the gradient is that of the mean loss over all dp * m micro-batches, the reference's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from labkit.collectives import Comm
from labkit.models.gpt import GPT, GPTConfig
from labkit.parallel.compose import compose
from labkit.parallel.layout import Layout, ParallelDegrees, build_layout, rank_grid
from labkit.pipeline.executor import embedding_groups, pipeline_step
from labkit.pipeline.schedules import make_schedule
from labkit.pipeline.stages import StageModule, check_pipeline, stage_layers
from labkit.tensor_parallel import TPConfig, vocab_parallel_cross_entropy
from labkit.zero.adam import AdamConfig
from labkit.zero.factory import make_optimizer

__all__ = [
    "ThreeD",
    "ThreeDConfig",
    "build_threed",
    "check_threed",
    "full_name",
    "full_size",
    "sum_tied_grads",
]


@dataclass(frozen=True)
class ThreeDConfig:
    """The parallel degrees and how a step runs: ``micro_batches`` per replica of
    ``micro_batch`` sequences each, the pipeline ``schedule`` (``virtual`` stages per rank for
    "interleaved"), ``zero``: "ddp" (all-reduce over dp) or "zero1" (optimizer state sharded
    over dp)."""

    degrees: ParallelDegrees = ParallelDegrees(2, 2, 2)
    micro_batches: int = 2
    micro_batch: int = 2
    schedule: str = "1f1b"
    virtual: int = 1
    zero: str = "ddp"
    checkpoint: Any = None  # an activation-checkpointing policy for compose ("full", ...)
    # blocks per pipeline stage (per virtual stage when interleaved: pp x virtual counts);
    # None: the even cut, or labkit.pipeline.cut's default spread when pp x v does not divide
    stage_layers: tuple[int, ...] | None = None

    @property
    def global_batch(self) -> int:
        return self.degrees.dp * self.micro_batches * self.micro_batch


def check_threed(model: GPTConfig, cfg: ThreeDConfig, world_size: int) -> None:
    """Every way a 3D job can be wrong before it starts, each error naming the values."""
    d = cfg.degrees
    d.check_world_size(world_size)
    d.check_model(hidden=model.n_embd, heads=model.n_head, vocab=model.vocab_size)
    check_pipeline(
        model.n_layer, d.pp, cfg.micro_batches, cfg.schedule, cfg.virtual, cfg.stage_layers
    )
    if cfg.zero not in ("ddp", "zero1"):
        raise ValueError(f"zero={cfg.zero!r}: 3D composes data parallelism as 'ddp' or 'zero1'")
    if model.dropout:
        raise ValueError(f"dropout={model.dropout}: the 3D lab runs without dropout")


class _TPStage(StageModule):
    """A pipeline stage that TAKES the (tensor-parallel) GPT's modules instead of copying
    them: their communicators hold process groups, which cannot be copied. The head of a
    tensor-parallel GPT shares its Parameter with ``wte``; on a rank holding only the last
    stage that Parameter is this stage's own copy of the tied weight."""

    def __init__(  # noqa: D107
        self, gpt: Any, stage: int, num_stages: int, layers_per_stage: Any = None
    ) -> None:
        nn.Module.__init__(self)
        self.stage, self.is_first, self.is_last = stage, stage == 0, stage == num_stages - 1
        self.tied = gpt.cfg.tie_weights
        if self.is_first:
            self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop
        layers = stage_layers(gpt.cfg.n_layer, num_stages, layers_per_stage)[stage]
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in layers})
        if self.is_last:
            self.ln_f, self.head = gpt.ln_f, gpt.head

    def tied_weight(self) -> nn.Parameter | None:
        """The tied embedding Parameter this stage holds (None: neither end, or untied)."""
        if not self.tied:
            return None
        mod: Any = self
        if self.is_first:
            return mod.wte.weight
        if self.is_last:
            return getattr(mod.head, "inner", mod.head).weight
        return None


class PipelineStages(nn.Module):
    """This rank's chunks (``v`` virtual stages) of the pipeline: what the pipeline hook of
    :func:`~labkit.parallel.compose` returns."""

    def __init__(self, chunks: list[_TPStage]) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)


def pipeline_hook(
    model: Any, pp_group: Any, *, virtual: int = 1, stage_layers: Any = None
) -> PipelineStages:
    """Cut this rank's stages (Megatron's interleaving: chunk c is stage c p + rank);
    ``stage_layers``: blocks per virtual stage (None: even, or the default spread)."""
    gpt = getattr(model, "gpt", model)  # the tensor-parallel wrapper keeps the GPT as .gpt
    rank, p = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    num = p * virtual
    return PipelineStages([_TPStage(gpt, c * p + rank, num, stage_layers) for c in range(virtual)])


def data_parallel_hook(model: nn.Module, dp_group: Any, *, zero: str, adam: AdamConfig) -> Any:
    """Attach the optimizer that reduces gradients over ``dp_group`` only."""
    model.optimizer = make_optimizer(zero, model, adam, group=dp_group)  # type: ignore[assignment]
    return model


def sum_tied_grads(chunks: list[Any], emb_group: Any) -> None:
    """Sum the tied weight's gradients of the first and last stage over ``emb_group``
    (Megatron's embedding group: same dp and tp index, pipeline ends; None: one rank holds
    both ends, and autograd already summed them)."""
    if emb_group is None:
        return
    for c in chunks:
        w = c.tied_weight()
        if w is not None and w.requires_grad:
            assert w.grad is not None
            dist.all_reduce(w.grad, group=emb_group)


def full_size(p: nn.Parameter, x: torch.Tensor, tp_group: Any) -> torch.Tensor:
    """``x`` (``p``'s value, or a stand-in of its shape) at full size: tensor-parallel shards
    (``p.tp_shard_dim``) all-gathered over ``tp_group``; replicated parameters as they are."""
    dim = getattr(p, "tp_shard_dim", None)
    t = dist.get_world_size(tp_group)
    if dim is None or t == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(t)]
    dist.all_gather(parts, x.contiguous(), group=tp_group)
    return torch.cat(parts, dim=dim)


def full_name(name: str) -> str:
    """A stage parameter's name in the unsharded GPT (drop wrappers and the chunk index)."""
    name = name.split(".", 2)[2] if name.startswith("chunks.") else name
    return name.replace(".inner", "").replace(".block.", ".")


class ThreeD:
    """One rank's share of a 3D-parallel GPT, its schedule, groups and optimizer."""

    def __init__(self, gpt: GPT, cfg: ThreeDConfig, layout: Layout, adam: AdamConfig) -> None:
        d = cfg.degrees
        self.cfg, self.layout, self.model_cfg = cfg, layout, gpt.cfg
        self.stages: Any = cast(Any, compose(
            gpt,
            layout,
            tensor_parallel=TPConfig(),
            checkpoint=cfg.checkpoint,
            pipeline=partial(pipeline_hook, virtual=cfg.virtual, stage_layers=cfg.stage_layers),
            data_parallel=partial(data_parallel_hook, zero=cfg.zero, adam=adam),
        ))  # fmt: skip
        self.chunks: list[Any] = [*self.stages.chunks]  # this rank's _TPStage chunks
        self.optimizer: Any = self.stages.optimizer
        self.sched = make_schedule(cfg.schedule, d.pp, cfg.micro_batches, cfg.virtual)
        # every rank creates every embedding pair (new_group is collective over the world)
        self.emb_group = embedding_groups(rank_grid(d)["pp"], cfg.virtual)
        self.loss_comm = Comm(layout.tp_group)
        self.pp_rank, self.dp_rank = layout.pp_rank, layout.dp_rank
        self.last: dict[str, float] = {}  # the last step's seconds by part (see step)

    def step(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> float | None:
        """One optimizer step on this replica's m micro-batches of tokens (b, T); returns the
        mean loss on the last stage's ranks (None elsewhere)."""
        self.optimizer.zero_grad()
        shape = (self.cfg.micro_batch, inputs[0].shape[1], self.model_cfg.n_embd)

        def loss_fn(logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
            return vocab_parallel_cross_entropy(logits, tgt, self.loss_comm)  # (b, T, V/t)

        t0 = time.perf_counter()
        res = pipeline_step(
            self.sched, self.chunks, inputs, targets, shape,
            group=self.layout.pp_group, loss_fn=loss_fn, barrier=False,
        )  # fmt: skip
        t1 = time.perf_counter()
        self.reduce_tied()
        t2 = time.perf_counter()
        self.optimizer.step()
        # where the step's seconds went on this rank: forward/backward actions (tensor-
        # parallel collectives included), waiting in the pipeline (bubble and p2p), the tied
        # embedding's all-reduce, and the optimizer step (the dp reduction included)
        busy = sum(end - start for a, start, end in res.timeline if a.is_compute)
        self.last = {"compute": busy, "pipeline_wait": t1 - t0 - busy, "tied": t2 - t1,
                     "optimizer": time.perf_counter() - t2}  # fmt: skip
        return res.loss

    def reduce_tied(self) -> None:
        """Sum the tied weight's gradients of the first and last stage (Megatron's embedding
        group: same dp and tp index, pipeline ends); one rank holding both: autograd did."""
        sum_tied_grads(self.chunks, self.emb_group)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters (shards), named as in the unsharded GPT."""
        return [(full_name(n), p) for n, p in self.stages.named_parameters()]

    def gather_full(self) -> dict[str, torch.Tensor]:
        """This stage's parameters at full size (tensor shards all-gathered over tp)."""
        return {name: full_size(p, p.detach(), self.layout.tp_group).clone()
                for name, p in self.named_parameters()}  # fmt: skip

    def close(self) -> None:
        if self.emb_group is not None:
            dist.destroy_process_group(self.emb_group)
            self.emb_group = None


def build_threed(
    gpt: GPT, cfg: ThreeDConfig, adam: AdamConfig | None = None, layout: Layout | None = None
) -> ThreeD:
    """Call on every rank with the same full ``gpt`` (one seed): this rank's :class:`ThreeD`."""
    check_threed(gpt.cfg, cfg, dist.get_world_size())
    layout = layout or build_layout(cfg.degrees)
    return ThreeD(gpt, cfg, layout, adam or AdamConfig())
