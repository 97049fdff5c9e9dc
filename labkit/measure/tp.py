"""Measurements of tensor parallelism: stored activations per layer, and the communication a
block should cost (the formula the counted bytes are tested against).

Activations: the tracker (:mod:`labkit.memory.tracker`) counts live tensor storages. Run one
block's forward with its input already alive and its output kept: the live bytes that
appear are what the block keeps for backward, plus its output, which is the next block's
LayerNorm input, the same size as this block's input (the formula counts the input). That is
Korthikanti et al. 2022's per-layer quantity, on this rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from labkit.memory.tracker import tracker_for

__all__ = ["BlockComm", "block_comm_formula", "layer_activation_bytes", "tp_layer_times"]


def layer_activation_bytes(gpt: Any, idx: torch.Tensor, block: int = 0) -> int:
    """Bytes block ``block`` of ``gpt`` (a labkit GPT, sharded or not) keeps alive for
    backward on this rank, measured with the live-tensor tracker, in training mode."""
    gpt.train()
    x = gpt.embed(idx)
    for b in gpt.blocks[:block]:
        x = b(x)
    with tracker_for(idx.device) as mt:
        # parameters are not activations: register them, or views like weight.t() count
        mt.register(gpt.parameters(), "parameters")
        before = mt.current_by_category()["activations"]
        y = gpt.blocks[block](x)
        mt.settle()  # cycles collected; gloo's threads let go of the collectives' tensors
        kept = mt.current_by_category()["activations"] - before
    del y
    return kept


@dataclass(frozen=True)
class BlockComm:
    """Collective calls and bytes sent by one rank for one block's forward + backward."""

    calls: dict[str, int]
    sent: dict[str, int]
    forward_calls: dict[str, int]  # the part of ``calls`` made by the forward pass


def block_comm_formula(
    batch: int, seq: int, hidden: int, tp: int, sp: bool, elem_bytes: int = 4
) -> BlockComm:
    """What one transformer block must communicate per micro-batch (forward and backward).

    Without SP (Shoeybi et al. 2019): g after attention and after the MLP forward, f before
    each backward: 4 all-reduces of the (b, s, h) activation. A ring all-reduce sends
    2 (t-1)/t of its bytes. With SP (Korthikanti et al. 2022): each all-reduce becomes an
    all-gather plus a reduce-scatter, (t-1)/t each, in both directions, and backward gathers
    the two saved input shards once more (section 4.2.2): 6 all-gathers, 4 reduce-scatters.
    """
    m = batch * seq * hidden * elem_bytes  # one full activation, bytes
    part = m * (tp - 1) // tp
    if not sp:
        return BlockComm({"all_reduce": 4}, {"all_reduce": 4 * 2 * part}, {"all_reduce": 2})
    return BlockComm(
        {"all_gather": 6, "reduce_scatter": 4},
        {"all_gather": 6 * part, "reduce_scatter": 4 * part},
        {"all_gather": 2, "reduce_scatter": 2},
    )


def tp_layer_times(
    batch: int,
    seq: int,
    hidden: int,
    tp: int,
    *,
    flops_per_s: float,
    alpha: float,
    beta: float,
    elem_bytes: int = 2,
) -> tuple[float, float]:
    """(compute, communication) seconds of one transformer layer's forward + backward on one
    of ``tp`` ranks, without overlap.

    Compute: a layer's matmuls cost 24 b s h^2 + 4 b s^2 h FLOPs forward (Narayanan et al.
    2021, eq. 2 per layer), twice that backward, split t ways. Communication: 4 ring
    all-reduces of the (b, s, h) activation (2 forward, 2 backward), each
    2 (t-1) alpha + 2 (t-1)/t * M * beta (labkit.collectives.cost_model). The compute shrinks as
    1/t, the bytes per rank do not: that is why TP stays where beta is small (NVLink).
    """
    from labkit.collectives.cost_model import ring_all_reduce_time

    flops = 3 * (24 * batch * seq * hidden**2 + 4 * batch * seq**2 * hidden) / tp
    comm = (
        4 * ring_all_reduce_time(batch * seq * hidden * elem_bytes, tp, alpha, beta)
        if tp > 1
        else 0.0
    )
    return flops / flops_per_s, comm
