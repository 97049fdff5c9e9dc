"""Both costs of activation checkpointing, measured on one training step: FLOPs and bytes.

Split from ``recompute.py`` (the technique), so that the lesson's claims are checked by code
that only measures. The arithmetic they check (``recompute.py`` derives it): a step without
checkpointing costs ``3F`` FLOPs for a forward of ``F``; checkpointing blocks whose forward is
``F_c`` adds exactly ``F_c`` (:func:`forward_flops`), counted to the FLOP by
``FlopCounterMode`` (:func:`step_flops`); the activations' peak drops to the blocks' inputs
plus one block's intermediates (:func:`step_activation_bytes`, the live-tensor tracker).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from labkit.activation_checkpoint.recompute import Policy, apply_activation_checkpointing

__all__ = ["LossFn", "forward_flops", "policy_costs", "step_activation_bytes", "step_flops"]


LossFn = Callable[..., torch.Tensor]


def _call(model: nn.Module, *inputs: Any) -> torch.Tensor:
    return model(*inputs)


def step_flops(model: nn.Module, *inputs: Any, loss_fn: LossFn = _call) -> int:
    """FLOPs of one ``loss_fn(model, *inputs).backward()``, counted by ``FlopCounterMode``.

    The count includes the recompute, because it runs inside the counted backward.
    ``loss_fn`` returns a scalar loss; the default calls ``model(*inputs)`` (a model that
    returns its loss). For labkit's GPT pass ``loss_fn=labkit.models.gpt_loss``.
    """
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        loss_fn(model, *inputs).backward()
    return int(counter.get_total_flops())


def forward_flops(module: nn.Module, *inputs: Any) -> int:
    """FLOPs of one forward of ``module`` (no graph): what a recompute of it adds."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        module(*inputs)
    return int(counter.get_total_flops())


def step_activation_bytes(
    model: nn.Module, *inputs: Any, loss_fn: LossFn = _call
) -> dict[str, int]:
    """Peak bytes of one ``loss_fn(model, *inputs).backward()`` on the model's device.

    Returns ``{"activations": ..., "total": ...}``: the peak of the "activations" ledger
    category (everything the step allocates besides parameters and gradients: saved
    tensors, recomputed intermediates, activation gradients), and the peak of all bytes
    allocated during the step. CPU: the live-tensor tracker (exact to the byte); CUDA:
    the caching allocator's statistics for the total.
    """
    from labkit.memory.tracker import tracker_for

    device = next(model.parameters()).device
    with tracker_for(device) as mt:
        mt.track_module(model)
        mt.reset_peak()
        loss_fn(model, *inputs).backward()
        peak = mt.ledger()
    return {"activations": peak.peak["activations"], "total": peak.peak_bytes}


def policy_costs(
    make_model: Callable[[], nn.Module],
    inputs: tuple[Any, ...],
    policies: dict[str, Policy],
    *,
    impls: tuple[str, ...] = ("labkit", "torch"),
    repeats: int = 5,
    loss_fn: LossFn = _call,
) -> dict[tuple[str, str], dict[str, float]]:
    """For each (policy name, impl): FLOPs, peak activation bytes and step seconds of a fresh
    ``make_model()`` whose ``.blocks`` are wrapped by that policy.

    Step times are taken round-robin over all configurations (a burst of load from another
    process then hits all of them alike), and each is the best of ``repeats``: on a shared
    machine the minimum is the estimate least disturbed by others. Memory and FLOPs are
    measured separately from timing (the tracker slows a step down).
    """
    import time

    models: dict[tuple[str, str], nn.Module] = {}
    costs: dict[tuple[str, str], dict[str, float]] = {}
    for name, policy in policies.items():
        for impl in impls:
            model = make_model()
            apply_activation_checkpointing(model.blocks, policy, impl=impl)  # type: ignore[arg-type]
            models[name, impl] = model
            costs[name, impl] = {
                "flops": step_flops(model, *inputs, loss_fn=loss_fn),  # also the warm-up step
                "activation_bytes": step_activation_bytes(model, *inputs, loss_fn=loss_fn)[
                    "activations"
                ],
                "seconds": float("inf"),
            }
    for _ in range(repeats):
        for key, model in models.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            loss_fn(model, *inputs).backward()
            costs[key]["seconds"] = min(costs[key]["seconds"], time.perf_counter() - start)
    return costs
