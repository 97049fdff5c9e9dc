"""Cut a labkit GPT into pipeline stages (virtual stages when interleaving), as modules.

Virtual stage ``s`` of ``S = p * v`` holds consecutive blocks, ``L / S`` of them when S
divides L; otherwise, or when ``layers_per_stage`` gives one count per virtual stage, as
:mod:`labkit.pipeline.cut` spreads them (the extra blocks go to the middle stages first).
Every block lands in exactly one stage. Stage 0 also holds the embedding (``wte``, ``wpe``,
``drop``), stage ``S - 1`` the head (``ln_f``, ``head``). Rank ``r`` holds stages
``r, r + p, ..., r + (v - 1) p`` (Megatron's interleaving).

Tied embeddings (Megatron's "embedding group", Shoeybi et al. 2019): the head reuses ``wte``.
When the first and last stage sit on different ranks, the last stage gets its OWN copy of
``wte`` (same values); each copy accumulates its use's gradient, and the two are all-reduced
(summed) between those two ranks before the optimizer step, so both hold the full gradient of
the shared weight and stay equal after identical updates. On one rank they are one Parameter.

Parameter names stay those of the full model (``blocks.3.attn.q.weight``), so a stage's
gradients compare one to one with a single-process reference.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from labkit.models.gpt import GPT
from labkit.pipeline.cut import layer_counts, stage_ranges

__all__ = ["StageModule", "build_stages", "check_pipeline", "stage_layers", "tied_pair"]


def check_pipeline(
    n_layer: int,
    p: int,
    m: int,
    schedule: str = "1f1b",
    v: int = 1,
    layers_per_stage: Sequence[int] | None = None,
) -> None:
    """Raise ``ValueError`` naming the numbers when the model cannot be cut or scheduled so:
    the schedule's (p, m, v), and the cut (:func:`labkit.pipeline.cut.layer_counts`: the
    default spread needs a block per stage; an explicit cut, one count per virtual stage
    summing to ``n_layer``). Call before any process starts."""
    from labkit.pipeline.schedules import check_schedule_args

    check_schedule_args(schedule, p, m, v)
    stages = p * v
    if layers_per_stage is None and stages > n_layer:
        raise ValueError(
            f"{stages} pipeline stages (p={p} x v={v}) but only n_layer={n_layer} layers: "
            "every stage needs at least one layer"
        )
    layer_counts(n_layer, stages, layers_per_stage)


def stage_layers(
    n_layer: int, num_stages: int, layers_per_stage: Sequence[int] | None = None
) -> list[range]:
    """Block indices of each virtual stage: consecutive slices, ``n_layer // S`` each when S
    divides ``n_layer``, else the default spread, or ``layers_per_stage`` (checked)."""
    return stage_ranges(n_layer, num_stages, layers_per_stage)


class StageModule(nn.Module):
    """One virtual stage: optional embedding, some blocks, optional head. First stage maps
    tokens (B, T) -> (B, T, d); middle (B, T, d) -> (B, T, d); last (B, T, d) -> logits."""

    def __init__(
        self,
        model: GPT,
        stage: int,
        num_stages: int,
        layers_per_stage: Sequence[int] | None = None,
    ):
        super().__init__()
        self.stage, self.is_first, self.is_last = stage, stage == 0, stage == num_stages - 1
        self.tied = model.cfg.tie_weights
        layers = stage_layers(model.cfg.n_layer, num_stages, layers_per_stage)[stage]
        if self.is_first:
            self.wte, self.wpe, self.drop = (
                copy.deepcopy(x) for x in (model.wte, model.wpe, model.drop)
            )
            self.block_size = model.cfg.block_size
        # keep the model's block numbering, so names match the reference's
        self.blocks = nn.ModuleDict({str(i): copy.deepcopy(model.blocks[i]) for i in layers})
        if self.is_last:
            self.ln_f, self.head = copy.deepcopy(model.ln_f), copy.deepcopy(model.head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))  # (B, T) -> (B, T, d)
        for block in self.blocks.values():
            x = block(x)
        if self.is_last:
            x = self.head(self.ln_f(x))  # (B, T, d) -> (B, T, vocab)
        return x


def build_stages(
    model: GPT, rank: int, p: int, v: int = 1, layers_per_stage: Sequence[int] | None = None
) -> list[StageModule]:
    """Rank ``rank``'s chunks: ``[stage(rank, 0), ..., stage(rank, v - 1)]``. Every rank
    builds the same full ``model`` (same seed) and keeps only its share. ``layers_per_stage``:
    blocks of each of the p x v virtual stages (default: the even cut, or the default spread
    of :mod:`labkit.pipeline.cut` when p x v does not divide ``n_layer``)."""
    num = p * v
    layer_counts(model.cfg.n_layer, num, layers_per_stage)  # a bad cut fails here, named
    chunks = [StageModule(model, c * p + rank, num, layers_per_stage) for c in range(v)]
    first = [c for c in chunks if c.is_first]
    last = [c for c in chunks if c.is_last]
    if first and last and model.cfg.tie_weights:
        last[0].head.weight = first[0].wte.weight  # type: ignore[assignment]  # one Parameter
    return chunks


def tied_pair(p: int, v: int) -> tuple[int, int]:
    """Pipeline ranks holding the first and last stage (the embedding group)."""
    return 0, (p * v - 1) % p
