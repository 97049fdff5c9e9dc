"""The one place where the order of composition is written.

    experts lifted -> tensor parallel -> experts placed (ep) -> context parallel (cp)
        -> activation checkpointing -> pipeline -> data parallel / ZeRO (over dp x cp)

Why this order:

0. **Experts lifted first** (a MoE GPT only): tensor parallelism knows dense MLPs, so the
   MoE layers leave the blocks (a dense stub holds their place) before it runs.
1. **Tensor parallelism**: it *replaces* layers (q/k/v, fc, projections, embedding,
   head) by their shards, copying the full model's weights. Anything that wrapped those layers
   earlier would wrap modules that no longer exist.
   **Then the experts return**, as :class:`~labkit.experts.parallel.ExpertParallelMoE` over
   ``ep_group`` (E / ep experts per rank, their hidden width split over tp): they replace
   whole MLPs, so they go in before anything wraps a block (checkpoint), cuts the model
   (pipeline) or registers gradient hooks (dp).
   **Then context parallelism** wraps each attention core *inside* the tp shard: it needs
   tp's (h/tp)-head q/k/v projections and swaps only the core (ring over ``cp_group``, zigzag
   split; or Ulysses), and the position embedding looks up this rank's global positions. The
   batch is split along the sequence by the caller (:func:`labkit.parallel.cp_ep.
   split_sequence`); the model never knows.
2. **Activation checkpointing** wraps whole blocks, which now contain the sharded layers and
   their collectives; the recompute in backward reruns those collectives, the same on every
   tensor-parallel rank, and the dropout masks repeat (``labkit.tensor_parallel.random``).
3. **Pipeline** cuts the (checkpointed, sharded) embedding / blocks / head into stages and
   keeps this rank's stage. A hook the pipeline lesson fills: ``pipeline(model, pp_group)``.
4. **Data parallelism / ZeRO last**: it synchronises or shards whatever parameters this rank
   finally holds (its tensor-parallel shard of its pipeline stage), over ``dp_cp_group``:
   with cp > 1 a dense parameter sees the tokens of every dp x cp rank, so its gradient is
   averaged over all of them (``dp_group`` when cp = 1). Expert parameters are the exception:
   their gradients are reduced over ``edp_group`` (the ranks holding the same experts), so a
   dp wrapper must not see them at ep > 1 (:func:`labkit.parallel.cp_ep.hidden_experts`).

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
from labkit.collectives import Comm
from labkit.parallel.cp_ep import context_parallel as make_cp
from labkit.parallel.cp_ep import lift_experts, place_experts
from labkit.parallel.layout import Layout
from labkit.tensor_parallel import tensor_parallel as make_tp

__all__ = ["compose"]

Wrap = Callable[[nn.Module, Any], nn.Module]  # (model, group) -> model


def compose(
    model: nn.Module,
    layout: Layout,
    *,
    tensor_parallel: Any = None,
    experts: bool = False,
    context_parallel: str | None = None,
    seq: int | None = None,
    checkpoint: Any = None,
    pipeline: Wrap | None = None,
    data_parallel: Wrap | None = None,
) -> nn.Module:
    """Apply the requested techniques to a labkit GPT in the one valid order.

    ``tensor_parallel``: a :class:`labkit.tensor_parallel.TPConfig` (None: no TP);
    ``experts``: the model's MoE layers become expert-parallel over ``layout.ep_group``;
    ``context_parallel``: "ring" or "ulysses" over ``layout.cp_group`` for sequences of
    ``seq`` positions (None: no CP);
    ``checkpoint``: an activation-checkpointing policy ("full", every k-th, a set of blocks);
    ``pipeline`` and ``data_parallel``: callables ``(model, group) -> model``.
    """
    lifted = lift_experts(model) if experts else {}
    if tensor_parallel is not None:
        model = make_tp(model, layout.tp_group, tensor_parallel)  # type: ignore[arg-type]
    if experts:
        tp_comm = None
        if tensor_parallel is not None:
            tp_comm = Comm(layout.tp_group, tensor_parallel.impl)
        place_experts(model, lifted, layout.ep_group, tp_comm)
    if context_parallel is not None:
        if seq is None:
            raise ValueError("context_parallel needs seq, the full sequence length")
        make_cp(model, layout.cp_group, context_parallel, seq)
    if checkpoint is not None:
        gpt: Any = getattr(model, "gpt", model)  # the TP wrapper keeps the GPT as .gpt
        apply_activation_checkpointing(gpt.blocks, checkpoint)
    if pipeline is not None:
        model = pipeline(model, layout.pp_group)
    if data_parallel is not None:
        dense = layout.dp_cp_group if layout.dp_cp_group is not None else layout.dp_group
        model = data_parallel(model, dense)
    return model
