"""ZeRO-2: shard the gradients too ("P_os+g").

In ZeRO-1 every rank keeps full gradients (4Psi in fp32) only to reduce-scatter them at
step time and keep 1/N. ZeRO-2 reduce-scatters each unit's gradients *during backward*, as
soon as autograd has produced all of them, straight into this rank's gradient shard, and
drops the full gradients right away::

    backward: unit's grads ready (post-accumulate-grad hooks)
              -> pack them into one (padded,) buffer -> reduce-scatter -> my_grad_shard += ...
              -> p.grad = None                      (full gradients never outlive their unit)
    step:     AdamW on my shard -> all-gather params (as ZeRO-1)

Memory per rank: 4Psi params + (4 + 8) Psi / N, plus one unit's full gradients in flight.
Communication is unchanged at 2Psi per step (one reduce-scatter + one all-gather), except
that with gradient accumulation each micro-batch reduce-scatters (DeepSpeed does the same):
the price of not keeping full gradients between micro-batches.

A unit whose parameters did not all get a gradient (unused in this forward) is flushed at
the end of backward with zeros for the missing ones, so every rank issues the same
collectives in the same order.
"""

from __future__ import annotations

import torch
from torch import nn

from labkit.zero.partition import flatten_into
from labkit.zero.stage1 import Unit, ZeRO1

__all__ = ["ZeRO2"]


class ZeRO2(ZeRO1):
    """AdamW with optimizer state and gradients sharded; grads reduce-scattered in backward."""

    def _build(self, u: Unit) -> None:
        super()._build(u)
        for p in u.params:
            p.grad = None
        u.grad = self._zeros(u.layout.shard_size, "gradients", self.param_dtype)  # my shard only
        self._hook_grads(u)

    def _hook_grads(self, u: Unit) -> None:
        if not hasattr(self, "_ready"):
            self._ready: dict[Unit, set[int]] = {}
            self._unit_of: dict[int, Unit] = {}
            self._flush_queued = False
        self._ready[u] = set()
        for p in u.params:
            self._unit_of[id(p)] = u
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, p: nn.Parameter) -> None:
        u = self._unit_of[id(p)]
        if not self._flush_queued:  # once per backward: settle incomplete units at the end
            self._flush_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)
        self._ready[u].add(id(p))
        if len(self._ready[u]) == len(u.params):
            self._reduce_unit(u)

    def _flush(self) -> None:
        self._flush_queued = False
        for u, ready in self._ready.items():
            if ready:
                self._reduce_unit(u)

    @torch.no_grad()
    def _reduce_unit(self, u: Unit) -> None:
        """Full grads of ``u`` -> one reduce-scatter -> added to my shard; full grads dropped."""
        self._ready[u] = set()
        buf = self._zeros(u.layout.padded, "temporaries", self.param_dtype)  # the communication buffer
        flatten_into(buf, u.layout, [p.grad for p in u.params])
        for p in u.params:
            p.grad = None
        mine = self._zeros(u.layout.shard_size, "temporaries", self.param_dtype)
        self.comm.reduce_scatter(mine, buf)
        del buf
        u.grad.add_(mine)
        self._after_reduce(u)

    def _after_reduce(self, u: Unit) -> None:
        """Hook for ZeRO-3, which frees the unit's gathered parameters here."""

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        for u in self.units:
            g = u.grad.float() / self.world_size  # sum over ranks -> average, in fp32
            self._update(u, g)
            del g
            self._publish(u)
