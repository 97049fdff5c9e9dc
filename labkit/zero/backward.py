"""Reduce each unit's gradients during backward: every unit once per backward, in an order
every rank agrees on.

ZeRO-2 and ZeRO-3 reduce-scatter a unit's gradients during backward, so that full gradients
never outlive their unit. Collectives pair up across ranks by issue order alone, so three
rules keep them paired whatever each rank's forward did:

1. **An order every rank agrees on.** With ``when="grads"`` (ZeRO-2) a unit is ready once
   autograd has produced all its gradients (a post-accumulate-grad hook per parameter), which
   can differ by rank: a rank that skipped a layer never completes the layer's unit. So units
   are reduced in one fixed order (reverse construction order, about the order backward
   produces them), a ready unit waiting for its predecessors, as
   :class:`labkit.ddp.overlapped.OverlappedDDP`'s buckets do. Without it, that rank would
   reduce the next unit while the others reduce the layer's: a size mismatch at best, at
   worst two units of one padded size summed into each other. With ``when="caller"``
   (ZeRO-3) the owner calls :meth:`BackwardReducer.reduce_now` at moments that are the same
   on every rank (the end of a module's backward), so units go as they come.
2. **Every unit once per backward.** At the end of backward :meth:`BackwardReducer.flush`
   reduces every unit not yet reduced, with zeros for the gradients this rank lacks.
3. **The end of the outermost backward.** ``queue_callback`` attaches the flush to the
   backward that is running when it is called. Activation checkpointing (labkit's reentrant
   kind) runs a nested backward per checkpointed block, so a flush queued from a parameter
   hook inside one would run at the end of that block and reduce partial units early. The
   flush is queued from a hook on the model's output instead: the first thing the outer
   backward computes.

The price of rule 1: a unit this rank produces no gradient for holds every later unit back
until the flush (correct, with the full gradients of those units alive meanwhile).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from labkit.zero.partition import Unit

__all__ = ["BackwardReducer"]


class BackwardReducer:
    """Calls ``reduce(unit)`` for every unit exactly once per backward, then ``after_flush()``
    at the end of the outermost backward. ``when``: ``"grads"`` or ``"caller"`` (see above)."""

    def __init__(
        self,
        model: nn.Module,
        units: Sequence[Unit],
        reduce: Callable[[Unit], None],
        *,
        when: str = "grads",
        after_flush: Callable[[], None] | None = None,
    ) -> None:
        if when not in ("grads", "caller"):
            raise ValueError(f"when must be 'grads' or 'caller', got {when!r}")
        self.order = list(reversed(units))
        self.reduce = reduce
        self.after_flush = after_flush
        self.unit_of = {id(p): u for u in units for p in u.params}
        self.name_of = {id(p): n for u in units for p, n in zip(u.params, u.names)}
        self._reset()
        for u in units:
            for p in u.params:
                p.register_post_accumulate_grad_hook(
                    self._on_grad if when == "grads" else lambda p: self._queue_flush()
                )
        model.register_forward_hook(self._watch_output)

    def _reset(self) -> None:
        self.missing = {u: len(u.params) for u in self.order}  # gradients not produced yet
        self.produced: set[int] = set()
        self.reduced: set[Unit] = set()
        self.next = 0  # with when="grads": self.order[:next] are reduced in this backward
        self.flush_queued = False

    def _watch_output(self, module: nn.Module, args: Any, out: Any) -> None:
        if torch.is_grad_enabled():
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad: self._queue_flush())

    def _queue_flush(self) -> None:
        if not self.flush_queued:  # once per backward
            self.flush_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)

    def _on_grad(self, p: nn.Parameter) -> None:
        self._queue_flush()  # normally queued already, from the output's hook
        if id(p) in self.produced:
            raise RuntimeError(
                f"the gradient of {self.name_of[id(p)]!r} was produced twice in one backward "
                "(a parameter used inside and outside a checkpointed block?): its unit was "
                "reduced already"
            )
        self.produced.add(id(p))
        self.missing[self.unit_of[id(p)]] -= 1
        while self.next < len(self.order) and self.missing[self.order[self.next]] == 0:
            self.next += 1
            self.reduce_now(self.order[self.next - 1])

    def reduce_now(self, u: Unit) -> None:
        """Reduce ``u`` now, unless it was reduced already in this backward."""
        self._queue_flush()
        if u not in self.reduced:
            self.reduced.add(u)
            self.reduce(u)

    def flush(self) -> None:
        """Reduce every unit not reduced yet (zeros for missing gradients), in order."""
        for u in self.order:
            self.reduce_now(u)
        self._reset()
        if self.after_flush is not None:
            self.after_flush()
