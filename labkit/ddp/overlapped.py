"""Overlapped DDP: each bucket's all-reduce starts from a gradient hook, while backward runs.

The idea of PyTorch DDP (Li et al., "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training", VLDB 2020): backward produces gradients last-layer-first, so the
bucket holding the last layers is complete long before backward ends. Send it then, and
the communication of bucket ``k`` hides behind the computation of the gradients of bucket
``k + 1``. Ideally only the last bucket's all-reduce is left exposed after backward::

    backward  |==== bucket 0 grads ====|==== bucket 1 grads ====|== bucket 2 ==|
    comm                               |-- all-reduce 0 --|     |-- ar 1 --|   |-- ar 2 --|
                                                                   exposed:   ^^^^^^^^^^^^

Why hooks: ``Tensor.register_post_accumulate_grad_hook`` runs right after autograd has
written a parameter's ``.grad`` (once per backward, after the uses of a tied parameter
have been summed), which is the earliest moment that gradient is final.

Two rules keep it correct:

* **Same order on every rank.** Collectives are matched by issue order, so a rank must not
  send bucket 2 before bucket 1 just because its bucket 2 happened to be ready first (a
  branch taken on one rank only changes the ready order). Buckets launch strictly in index
  order: a ready bucket waits for its predecessors.
* **Everything is sent before the step.** A parameter that got no gradient on this rank
  never fires its hook; :meth:`finish_gradient_sync` launches whatever is left (zeros plus
  a "not used" flag), then waits for every bucket and writes the averages back.

What we leave out: a bucket holding a parameter unused *on this rank* is only sent from
``finish_gradient_sync``, and the in-order rule holds every later bucket back with it (correct,
just less overlap). torch DDP's ``find_unused_parameters=True`` walks the autograd graph after
forward to mark such parameters ready at once; it also rebuilds buckets in the gradient order
observed in the first iteration.

``grad_as_bucket_view=True`` is torch DDP's option of the same name, done as torch does it: the
hook copies each gradient into its slot of the bucket at once, divided by ``world_size`` on the
way (torch DDP's arithmetic), and points ``.grad`` at that slot, so autograd's own tensor is
freed during backward, not after the step. After the all-reduce ``.grad`` already holds the
average: one pass over the gradients a step instead of two, and one copy of them instead of
two. The price is torch's too: a ``.grad`` kept past the next backward is overwritten by it
(clone it to keep it). ``benchmarks/bench_ddp.py`` times both modes against torch DDP's both.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from labkit.ddp.base import DataParallel, Pending
from labkit.ddp.bucketed import bucket_cap_bytes, make_buckets


class OverlappedDDP(DataParallel):
    """Buckets of ``bucket_cap_mb`` whose all-reduces start from gradient hooks, in order."""

    def __init__(
        self,
        module: nn.Module,
        *,
        bucket_cap_mb: float = 1.0,
        grad_as_bucket_view: bool = False,
        **options: Any,
    ):
        """``options``: ``group``, ``comm``, ``record_events``, ``compression``, as for
        :class:`DataParallel`; ``grad_as_bucket_view``: see the module docstring."""
        cap = bucket_cap_bytes(bucket_cap_mb)  # checked before the broadcast communicates
        super().__init__(module, **options)
        self.bucket_cap_mb = bucket_cap_mb
        self.grad_as_bucket_view = grad_as_bucket_view
        # views: the slots hold the mean (a compression computes the mean itself). Passed only
        # when set, so a subclass overriding unpack(buf, params) still works.
        self.scale = 1 / self.world_size if self.compression is None else 1.0
        self._unpack_kw = {"as_views": True} if grad_as_bucket_view else {}
        self.buckets = make_buckets(self.params, cap)  # the same buckets as BucketedDDP's
        self.bucket_of = {id(p): k for k, bucket in enumerate(self.buckets) for p in bucket}
        self.index_in_bucket = {id(p): i for bucket in self.buckets for i, p in enumerate(bucket)}
        # views: each bucket's buffer and slots, looked up once here rather than in every hook
        self.views = [self.buffer_of(b) for b in self.buckets] if grad_as_bucket_view else []
        self._reset()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _reset(self) -> None:
        """Per-step state: gradients still missing per bucket, next bucket to launch, in flight."""
        self.missing = [len(bucket) for bucket in self.buckets]
        self.ready: set[int] = set()
        self.next_bucket = 0  # buckets launch in this order, on every rank
        self.inflight: list[tuple[int, torch.Tensor, Pending]] = []  # (bucket, buffer, all-reduce)
        self.filled: set[int] = set()  # views: parameters already in their bucket slot

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        """Autograd wrote ``p.grad``: launch every bucket that is now complete, in index order."""
        if not self.require_sync:  # inside no_sync(): accumulate only
            return
        if id(p) in self.ready:
            raise RuntimeError(
                f"gradient of {self.names[id(p)]!r} was produced twice before "
                "finish_gradient_sync(); accumulate micro-batches inside no_sync()"
            )
        self.ready.add(id(p))
        if self.grad_as_bucket_view:
            self._fill(p)
        self.missing[self.bucket_of[id(p)]] -= 1
        while self.next_bucket < len(self.buckets) and self.missing[self.next_bucket] == 0:
            self._launch(self.next_bucket)

    def _fill(self, p: nn.Parameter) -> None:
        """Views: ``p``'s gradient / world_size into its slot, its used flag, ``.grad`` -> slot."""
        buf, slots = self.views[self.bucket_of[id(p)]]
        i = self.index_in_bucket[id(p)]
        self.put_grad(buf, slots, i, p, self.scale)
        if p.grad is not None:
            p.grad = slots[i].view_as(p)
        self.filled.add(id(p))

    def _launch(self, k: int) -> None:
        if self.grad_as_bucket_view:  # what no hook filled: unused here, or used only in no_sync
            for p in self.buckets[k]:
                if id(p) not in self.filled:
                    self._fill(p)
            buf = self.views[k][0]
        else:
            buf = self.pack(self.buckets[k])  # (sum numel + len(bucket),)
        self.inflight.append((k, buf, self.start_allreduce(buf, f"bucket {k}")))
        self.next_bucket += 1

    def finish_gradient_sync(self) -> None:
        """Launch the buckets still waiting, wait for every bucket, write the averages back."""
        if not self.require_sync:
            return
        self.elements_reduced = 0
        while self.next_bucket < len(self.buckets):  # buckets with a param unused on this rank
            self._launch(self.next_bucket)
        for k, buf, pending in self.inflight:
            pending.wait()
            self.unpack(buf, self.buckets[k], **self._unpack_kw)
        self._reset()

    def extra_repr(self) -> str:
        views = ", grad_as_bucket_view=True" if self.grad_as_bucket_view else ""
        buckets = f"buckets={len(self.buckets)}, cap={self.bucket_cap_mb} MB"
        return f"{super().extra_repr()}, {buckets}{views}"
