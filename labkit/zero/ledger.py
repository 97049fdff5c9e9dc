"""The measured memory ledger: run a few training steps of one stage under the tracker.

Call :func:`measure` on every rank (inside :func:`labkit.launch`). It returns, for this rank,
the bytes per category (current after the last step and peak over the steps), the bytes
sent per collective, and the prediction of :mod:`labkit.memory.model` for the same run, so
callers can put measured next to predicted.

How allocations get their category: the ZeRO classes allocate the buffers they own (flat
parameters, gradient buffers or shards, Adam moments, communication buffers) inside
``tracker.category(...)`` (their ``memory=`` argument); everything allocated in forward is an
activation; whatever else appears during backward and ``step`` (autograd's per-parameter
gradients before they are reduced, Adam's scratch, all-gather inputs) is a temporary.

Because those labels come from the code under test, :func:`measure` also returns two numbers
measured without it, for an independent check of the total peak: the activation peak of one
plain forward + backward of the same model on the same micro-batch (no ZeRO, one process),
and the size of the largest unit (what one unit's temporaries are made of).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit.activation_checkpoint import step_activation_bytes
from labkit.memory import tracker_for
from labkit.memory.model import FP32_ADAM, MIXED_ADAM, communication_bytes, model_states
from labkit.models import GPTConfig
from labkit.zero.adam import AdamConfig
from labkit.zero.factory import make_optimizer

__all__ = ["DEFAULT_GPT", "measure", "measure_gpt"]

DEFAULT_GPT = GPTConfig(n_layer=6, n_embd=384, n_head=6, block_size=32)  # 10.7M parameters


def measure(
    stage: str,
    build_model: Callable[[], nn.Module],
    batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    steps: int = 2,
    cfg: AdamConfig | None = None,
    device: torch.device | None = None,
    **opt_kwargs: Any,
) -> dict[str, Any]:
    """Train ``steps`` steps of ``stage`` on this rank under the tracker; return the ledger.

    ``batch(rank, step) -> (x, y)`` gives this rank's micro-batch; ``loss_fn(model, x, y)``.
    """
    device = device or torch.device("cpu")
    dtype = opt_kwargs.get("param_dtype", torch.float32)
    plain = build_model().to(device, dtype)  # the same model, no ZeRO: its activations
    x, y = batch(dist.get_rank(), 0)
    plain_activations = step_activation_bytes(plain, x, y, loss_fn=loss_fn)["activations"]
    del plain, x, y
    with tracker_for(device) as mt:
        model = build_model().to(device)
        opt = make_optimizer(stage, model, cfg, memory=mt, **opt_kwargs)
        frozen = [p for p in model.parameters() if not p.requires_grad]
        mt.register(frozen, "parameters")
        mt.settle()  # the set-up's collectives may still hold tensors on gloo's threads
        mt.reset_peak()
        opt.comm.reset()
        for step in range(steps):
            x, y = batch(opt.rank, step)
            opt.zero_grad()
            with mt.category("activations"):
                loss = loss_fn(model, x, y)
            with mt.category("temporaries"):
                loss.backward()
                del loss
                opt.step()
            del x, y
        # gloo's worker threads drop their reference to a finished collective's tensors a
        # moment after the caller has returned (longer on a loaded machine): give them up to
        # a second before reading what the step left behind; a real leak stays
        for _ in range(100):
            if mt.current_by_category()["temporaries"] == 0:
                break
            time.sleep(0.01)
        ledger = mt.ledger()
    psi = opt.num_params
    n = opt.world_size
    mixed = opt.param_dtype != torch.float32  # 16-bit params and grads, fp32 master + moments
    pred = model_states(stage, psi, n, MIXED_ADAM if mixed else FP32_ADAM)
    frozen_bytes = sum(p.numel() * p.element_size() for p in frozen)
    return {
        "stage": stage,
        "param_dtype": str(opt.param_dtype).removeprefix("torch."),
        "world_size": n,
        "psi": psi,
        "current": ledger.current,
        "peak": ledger.peak,
        "at_peak": ledger.at_peak,
        "peak_bytes": ledger.peak_bytes,
        "predicted": {
            "parameters": pred.parameters + frozen_bytes,
            "gradients": pred.gradients,
            "optimizer_state": pred.optimizer_state,
        },
        "sent_per_step": {k: v / steps for k, v in opt.comm.sent.items()},
        "calls_per_step": {k: v / steps for k, v in opt.comm.calls.items()},
        "plain_activations": plain_activations,
        "largest_unit_bytes": max(u.layout.padded for u in opt.units) * opt.param_dtype.itemsize,
        "sent_predicted": communication_bytes(stage, psi, elem_bytes=2 if mixed else 4)
        * (n - 1)
        / n,
    }


def measure_gpt(
    stages: tuple[str, ...] = ("ddp", "zero1", "zero2", "zero3"),
    gpt: Any = None,
    *,
    batch: int = 1,
    steps: int = 1,
    **opt_kwargs: Any,
) -> list[dict[str, Any]]:
    """:func:`measure` every stage on a labkit GPT (default: 6 layers x 384, 10.7M parameters)."""
    from labkit.launch import local_device
    from labkit.models import GPT, gpt_loss

    cfg = gpt or DEFAULT_GPT
    device = local_device()

    def build() -> nn.Module:
        torch.manual_seed(0)
        return GPT(cfg)

    def make_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g).to(device)
        return x, torch.roll(x, -1, 1)  # (batch, T) next-character targets

    return [
        measure(s, build, make_batch, gpt_loss, steps=steps, device=device, **opt_kwargs)
        for s in stages
    ]
