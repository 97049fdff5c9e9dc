"""The one place where the order of composition is written.

    tensor parallel -> activation checkpointing -> pipeline -> data parallel / ZeRO

Why this order:

1. **Tensor parallelism first**: it *replaces* layers (q/k/v, fc, projections, embedding,
   head) by their shards, copying the full model's weights. Anything that wrapped those layers
   earlier would wrap modules that no longer exist.
2. **Activation checkpointing** wraps whole blocks, which now contain the sharded layers and
   their collectives; the recompute in backward reruns those collectives, the same on every
   tensor-parallel rank, and the dropout masks repeat (``labkit.tensor_parallel.random``).
3. **Pipeline** cuts the (checkpointed, sharded) embedding / blocks / head into stages and
   keeps this rank's stage. A hook the pipeline lesson fills: ``pipeline(model, pp_group)``.
4. **Data parallelism / ZeRO last**: it synchronises or shards whatever parameters this rank
   finally holds (its tensor-parallel shard of its pipeline stage), over ``dp_group``.

Every step receives its process group from the :class:`~labkit.parallel.Layout`. This module
sits above the techniques it composes and imports them at the top; ``labkit.parallel``'s
``__init__`` does not import it (techniques import ``labkit.parallel.layout``).
:mod:`labkit.parallel.threed` fills the two hooks for dp x tp x pp: ``pipeline_hook`` keeps
this rank's stage(s) of the tensor-parallel GPT, ``data_parallel_hook`` gives them an AdamW
(DDP or ZeRO-1) that reduces gradients over ``dp_group`` only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from labkit.activation_checkpoint import apply_activation_checkpointing
from labkit.parallel.layout import Layout
from labkit.tensor_parallel import tensor_parallel as make_tp

__all__ = ["compose"]

Wrap = Callable[[nn.Module, Any], nn.Module]  # (model, group) -> model


def compose(
    model: nn.Module,
    layout: Layout,
    *,
    tensor_parallel: Any = None,
    checkpoint: Any = None,
    pipeline: Wrap | None = None,
    data_parallel: Wrap | None = None,
) -> nn.Module:
    """Apply the requested techniques to a labkit GPT in the one valid order.

    ``tensor_parallel``: a :class:`labkit.tensor_parallel.TPConfig` (None: no TP);
    ``checkpoint``: an activation-checkpointing policy ("full", every k-th, a set of blocks);
    ``pipeline`` and ``data_parallel``: callables ``(model, group) -> model``.
    """
    if tensor_parallel is not None:
        model = make_tp(model, layout.tp_group, tensor_parallel)  # type: ignore[arg-type]
    if checkpoint is not None:
        gpt: Any = getattr(model, "gpt", model)  # the TP wrapper keeps the GPT as .gpt
        apply_activation_checkpointing(gpt.blocks, checkpoint)
    if pipeline is not None:
        model = pipeline(model, layout.pp_group)
    if data_parallel is not None:
        model = data_parallel(model, layout.dp_group)
    return model
