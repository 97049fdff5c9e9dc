"""ZeRO-2: shard the gradients too (Rajbhandari et al. 2019, "P_os+g"), as FSDP SHARD_GRAD_OP.

In ZeRO-1 every rank keeps full gradients (4Psi in fp32) only to reduce-scatter them at step
time and keep 1/N. ZeRO-2 reduce-scatters each unit's gradients *during backward*, as soon
as autograd has produced all of them, straight into this rank's gradient shard, and drops
the full gradients right away::

    backward: unit's grads ready (post-accumulate-grad hooks)
              -> ShardedAdamW.reduce_scatter_grads: pack them into one (padded,) buffer
              -> reduce-scatter -> my grad shard += ... -> p.grad = None
                 (full gradients never outlive their unit)
    step:     AdamW on my shard -> all-gather params (as ZeRO-1)

Memory per rank, fp32: 4Psi params + (4 + 8) Psi / N, plus the full gradients of the units
produced but not yet reduced (one, when backward produces units in their reduce order).
Communication is unchanged at 2Psi per step (one reduce-scatter + one all-gather), except
that with gradient accumulation each micro-batch reduce-scatters (DeepSpeed does the same):
the price of not keeping full gradients between micro-batches.

When to reduce which unit is :class:`labkit.zero.backward.BackwardReducer`'s job: one fixed
order on every rank, every unit once per backward (zeros from a rank that did not use it),
the flush at the end of the outermost backward (so activation checkpointing's nested
backwards change nothing). Layers that some ranks skip are therefore safe; a parameter no
rank used is skipped as ``torch.optim.AdamW`` skips it (:mod:`labkit.zero.sharded`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from labkit.zero.adam import AdamConfig
from labkit.zero.backward import BackwardReducer
from labkit.zero.sharded import ShardedAdamW

__all__ = ["ZeRO2"]


class ZeRO2(ShardedAdamW):
    """AdamW with optimizer state and gradients sharded; grads reduce-scattered in backward.
    Keyword arguments: see :class:`ShardedAdamW`."""

    def __init__(self, model: nn.Module, cfg: AdamConfig | None = None, **kwargs: Any) -> None:
        super().__init__(model, cfg, shard_optimizer=True, **kwargs)
        for u in self.units:  # my gradient shard only; autograd's p.grad is dropped per unit
            u.grad = self.zeros(u.layout.shard_size, "gradients", self.param_dtype)
        self.reducer = BackwardReducer(model, self.units, self.reduce_scatter_grads)

    @torch.no_grad()
    def step(self) -> bool:
        """AdamW on my shard, all-gather. False when a loss scaler skipped the step."""
        return self.apply_step(
            lambda u: self.policy.grad_to_master(u.grad, self.world_size),  # fp32 average
            publish=self.all_gather_params,
        )
