"""Stage 0, the baseline ZeRO is measured against: data parallelism with AdamW everywhere.

Every rank keeps everything: full parameters, full gradients and Adam's two moments of every
parameter. One step::

    grads (full, every rank) --all-reduce--> the sum on every rank        sends 2 (N-1)/N Psi
    AdamW on every element, on every rank (the same update N times)       K Psi memory

Memory per rank, fp32: (4 + 4 + 8) Psi, whatever N. That redundancy is what ZeRO removes.

The parameters and gradients live in one flat buffer per unit (:mod:`labkit.zero.partition`)
so that one collective moves a whole unit; ``p.data`` and ``p.grad`` are views into them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from labkit.zero.adam import AdamConfig
from labkit.zero.partition import Unit
from labkit.zero.sharded import ShardedAdamW, adopt_grads

__all__ = ["DDPAdam"]


class DDPAdam(ShardedAdamW):
    """AdamW over ``group`` with nothing sharded. Call ``zero_grad``, backward (once per
    micro-batch), then ``step``. Keyword arguments: see :class:`ShardedAdamW`."""

    def __init__(self, model: nn.Module, cfg: AdamConfig | None = None, **kwargs: Any) -> None:
        super().__init__(model, cfg, shard_optimizer=False, **kwargs)
        for u in self.units:
            u.grad = self.zeros(u.layout.padded, "gradients", self.param_dtype)
            adopt_grads(u)  # p.grad: views, autograd accumulates micro-batches into the buffer

    @torch.no_grad()
    def step(self) -> bool:
        """All-reduce, AdamW on everything. False when a loss scaler skipped the step."""

        def average(u: Unit) -> torch.Tensor:
            adopt_grads(u)  # in case someone replaced p.grad since zero_grad
            self.comm.all_reduce(u.grad)  # (padded,): the sum over ranks, on every rank
            return self.policy.grad_to_master(u.grad, self.world_size)  # fp32 average

        return self.apply_step(average)
