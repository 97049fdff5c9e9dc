"""ZeRO-1: shard the optimizer state (Rajbhandari et al. 2019, "P_os").

Every rank keeps the full parameters and full gradients, but Adam's two fp32 moments only
for its 1/N shard of each unit's flat buffer (:mod:`labkit.zero.partition`). One step::

    grads (full, every rank) --reduce-scatter--> my shard of their sum      sends (N-1)/N Psi
    AdamW on my shard only (params, m, v of my shard)                       K Psi / N memory
    my updated param shard --all-gather--> full params on every rank        sends (N-1)/N Psi

Communication: a reduce-scatter plus an all-gather is exactly what a ring all-reduce does
internally, so ZeRO-1 costs the same 2Psi per rank as DDP (:mod:`labkit.zero.stage0`) while
cutting the optimizer state from K Psi to K Psi / N. Memory per rank, fp32:
4Psi params + 4Psi grads + 8Psi/N Adam.

Mixed precision (``param_dtype=torch.bfloat16`` or float16, the paper's setting, policy from
:class:`labkit.precision.mixed.PrecisionPolicy`): the model computes with 16-bit parameters
and gradients (2 + 2 bytes each); every rank keeps an fp32 *master* copy of its shard next
to Adam's moments (4 + 4 + 4 = the paper's K = 12, all sharded), updates the master, rounds
it into its 16-bit shard and all-gathers 16-bit values, so communication is 2 bytes per
element too. With float16 pass a :class:`labkit.precision.DynamicLossScaler` (``scaler=``)
and backward ``scaler.scale(loss)``; ``step`` then skips a step whose gradients overflowed.

Parameters are grouped into *units* (default: the trainable parameters each module owns
directly), each one flat buffer padded to a multiple of N. Frozen parameters
(``requires_grad=False``) are not managed: they stay as they are on every rank.

Rank-dependent control flow is harmless here: nothing communicates during backward, and at
``step`` every rank reduces every unit in the same order (zeros for gradients it did not
produce). A parameter no rank used is skipped as ``torch.optim.AdamW`` skips it
(:mod:`labkit.zero.sharded`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from labkit.zero.adam import AdamConfig
from labkit.zero.partition import Unit
from labkit.zero.sharded import ShardedAdamW, adopt_grads

__all__ = ["ZeRO1"]


class ZeRO1(ShardedAdamW):
    """AdamW with the optimizer state sharded over ``group``. Call ``zero_grad``, backward
    (once per micro-batch), then ``step``. Keyword arguments: see :class:`ShardedAdamW`."""

    def __init__(self, model: nn.Module, cfg: AdamConfig | None = None, **kwargs: Any) -> None:
        super().__init__(model, cfg, shard_optimizer=True, **kwargs)
        for u in self.units:  # full gradients: the micro-batches accumulate into them
            u.grad = self.zeros(u.layout.padded, "gradients", self.param_dtype)
            adopt_grads(u)

    @torch.no_grad()
    def step(self) -> bool:
        """Reduce-scatter, AdamW on my shard, all-gather. False when a loss scaler skipped it."""

        def my_average(u: Unit) -> torch.Tensor:  # unit by unit, the same order on every rank
            adopt_grads(u)
            mine = self.zeros(u.layout.shard_size, "temporaries", self.param_dtype)
            self.comm.reduce_scatter(mine, u.grad)  # (padded,) -> (shard_size,), summed
            return self.policy.grad_to_master(mine, self.world_size)  # fp32 average

        return self.apply_step(my_average, publish=self.all_gather_params)
