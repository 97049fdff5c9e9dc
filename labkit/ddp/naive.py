"""Naive DDP: after backward, one all-reduce per parameter.

The simplest correct data parallelism. Its cost model shows why nobody ships it: each
collective pays a fixed latency ``alpha`` (gloo on this machine: ~80 us one way, far more
for a full all-reduce) on top of the bandwidth term, so for ``P`` parameter tensors of
``N`` bytes in total one step costs roughly::

    P * alpha  +  2 (W - 1) / W * N / bandwidth          (ring all-reduce)

A ResNet-50 has P = 161 tensors, GPT-2 small 148 (with its fused qkv, as released; labkit's
GPT has separate q, k, v: 196): the latency term dominates for small tensors.
:mod:`labkit.ddp.flat` pays ``alpha`` once.

Each parameter's gradient travels with its "used" flag (see :class:`DataParallel.pack`),
so a parameter that got no gradient on some rank still joins the collective with zeros.
"""

from __future__ import annotations

from labkit.ddp.base import DataParallel


class NaiveDDP(DataParallel):
    """One blocking all-reduce per trainable parameter, in registration order."""

    def finish_gradient_sync(self) -> None:
        """Average the gradients over the group; call after the last backward, before step()."""
        if not self.require_sync:
            return
        self.elements_reduced = 0
        for p in self.params:
            buf = self.pack([p])  # (numel + 1,): gradient, then its used flag
            self.all_reduce(buf, self.names[id(p)])
            self.unpack(buf, [p])
