"""What every data-parallel variant shares: the wrapper, the averaging rule and the bookkeeping.

Data parallelism (DDP) in one invariant: *after the gradient sync, every rank holds the
gradient of the mean loss over the union of all ranks' micro-batches*, i.e.::

    grad = (1 / world_size) * sum_r grad_r        where grad_r = d mean_loss(x_r) / d params

so that one optimizer step on any rank equals one step of single-process training on the
full batch. The parameters start identical (rank 0's are broadcast) and every rank applies
the same update, so they stay bit-identical on every rank forever.

The variants in this package differ only in *how* the sum is communicated:

=============  ====================================================  ======================
module         communication                                          collectives per step
=============  ====================================================  ======================
naive.py       one all-reduce per parameter, after backward           num_params + 1
flat.py        all gradients in one contiguous buffer, one all-reduce 1
bucketed.py    buffers of ``bucket_cap_mb``, reverse order of use     num_buckets
overlapped.py  the same buckets, launched from gradient hooks         num_buckets (hidden)
=============  ====================================================  ======================

Usage, the same for all of them (and close to ``torch.nn.parallel.DistributedDataParallel``)::

    model = OverlappedDDP(net, group=None, bucket_cap_mb=1.0)
    for i, (x, y) in enumerate(batches):
        with model.no_sync() if (i + 1) % accum else contextlib.nullcontext():
            (loss_fn(model(x), y) / accum).backward()
        if (i + 1) % accum == 0:
            model.finish_gradient_sync()   # torch DDP hides this inside backward()
            opt.step(); opt.zero_grad(set_to_none=True)

Awkward parameters, handled by every variant:

* **frozen** (``requires_grad=False``): broadcast at start, never reduced.
* **tied** (one ``Parameter`` reachable twice, e.g. GPT's embedding and head): autograd sums
  both uses into one ``.grad``; it is listed and reduced *once* (``named_parameters``
  de-duplicates by identity).
* **no gradient in a step** (a branch not taken): another rank may have taken it, so every
  rank still takes part in the collective, contributing zeros. One extra "used" flag per
  parameter travels in the same buffer; a parameter no rank used keeps ``grad=None``, so the
  optimizer skips it exactly as in single-process training (momentum and weight decay
  would otherwise move it).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit.parallel.layout import global_rank

AllReduceFn = Callable[[torch.Tensor, Any], None]
"""An in-place SUM all-reduce: ``fn(tensor, group) -> None``, e.g. labkit's ring all-reduce."""


def torch_all_reduce(tensor: torch.Tensor, group: Any = None) -> None:
    """The default ``allreduce_fn``: PyTorch's own all-reduce (gloo on CPU, NCCL on GPUs)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


@dataclass
class Event:
    """One interval on the timeline, in seconds since the wrapper's ``forward`` of this step."""

    kind: str  # "backward" or "allreduce"
    name: str
    start: float
    end: float


class DataParallel(nn.Module):
    """Base of the variants: wraps ``module``; subclasses implement :meth:`_sync`.

    ``group``: the process group the gradients are averaged over (None = WORLD).
    ``allreduce_fn``: the collective used, ``(tensor, group) -> None`` in-place sum;
    None means :func:`torch_all_reduce`. ``record_events``: keep a timeline of the last step
    in :attr:`events` (host clock; on CUDA the all-reduce ends are completion callbacks).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        group: Any = None,
        allreduce_fn: AllReduceFn | None = None,
        record_events: bool = False,
    ):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                f"{type(self).__name__} needs torch.distributed initialised "
                "(run it inside labkit.launch(...) or torchrun)"
            )
        if allreduce_fn is not None and not callable(allreduce_fn):
            raise TypeError(f"allreduce_fn must be callable (tensor, group) -> None, got {allreduce_fn!r}")
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.allreduce_fn: AllReduceFn = allreduce_fn or torch_all_reduce
        self.custom_allreduce = allreduce_fn is not None
        self.record_events = record_events
        self.events: list[Event] = []
        self.elements_reduced = 0  # summed over the last sync: proves tied weights go once
        self.require_sync = True
        self._t0 = time.perf_counter()
        self._comm_thread: ThreadPoolExecutor | None = None
        self._comm_buffers: dict[tuple[int, ...], torch.Tensor] = {}

        # The trainable parameters, each once, in registration order (~ order of use in
        # forward). Frozen ones are broadcast but never reduced.
        self.params: list[nn.Parameter] = [p for p in module.parameters() if p.requires_grad]
        self.names: dict[int, str] = {id(p): n for n, p in module.named_parameters()}
        kinds = {(p.dtype, p.device) for p in self.params}
        if len(kinds) > 1:
            raise ValueError(
                f"all trainable parameters must share one dtype and device to share a buffer, "
                f"got {sorted(str(k) for k in kinds)}"
            )
        self._broadcast_from_rank0()

    # ---- the wrapper -------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.require_sync and self.record_events:
            self.events = []
            self._t0 = time.perf_counter()
        out = self.module(*args, **kwargs)
        if self.record_events and isinstance(out, torch.Tensor) and out.requires_grad:
            # The gradient w.r.t. the output is the first thing backward computes.
            out.register_hook(self._mark_backward_start)
        return out

    def _mark_backward_start(self, grad: torch.Tensor) -> None:
        self._backward_start = self.now()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward inside this context only accumulates locally.

        Syncing every micro-step would cost ``accum`` times the communication for the same
        result: the sum is linear, so one all-reduce of the accumulated gradient suffices.
        """
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def finish_gradient_sync(self) -> None:
        """Average the gradients over the group; call after the last backward, before step()."""
        self.elements_reduced = 0
        start = self.now()
        self._sync()
        if self.record_events:
            bwd_start = getattr(self, "_backward_start", start)
            self.events.insert(0, Event("backward", "backward", bwd_start, self._backward_end(start)))

    def _backward_end(self, sync_called: float) -> float:
        return sync_called  # variants that see gradient hooks know better

    def _sync(self) -> None:
        raise NotImplementedError

    # ---- helpers for the variants -------------------------------------------------------

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def _broadcast_from_rank0(self) -> None:
        """Every rank starts from rank 0's parameters and buffers (frozen ones included)."""
        src = global_rank(self.group, 0)
        with torch.no_grad():
            for t in [*self.module.parameters(), *self.module.buffers()]:
                dist.broadcast(t.data, src=src, group=self.group)

    def pack(self, params: list[nn.Parameter]) -> torch.Tensor:
        """``[grad_0.flatten(), ..., grad_k.flatten(), used_0, ..., used_k]`` in one buffer.

        A missing gradient contributes zeros; its ``used`` flag is 0. After the SUM all-reduce
        the flag counts the ranks that used the parameter.
        """
        key = tuple(id(p) for p in params)
        n = sum(p.numel() for p in params)
        buf = self._comm_buffers.get(key)
        if buf is None:  # allocated once and reused: a fresh buffer per step pays page faults
            buf = torch.empty(n + len(params), dtype=params[0].dtype, device=params[0].device)
            self._comm_buffers[key] = buf
        offset = 0
        for i, p in enumerate(params):
            view = buf[offset : offset + p.numel()]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))  # (numel,)
            buf[n + i] = 0.0 if p.grad is None else 1.0
            offset += p.numel()
        return buf

    def unpack(self, buf: torch.Tensor, params: list[nn.Parameter]) -> None:
        """Write the averaged gradients back; a parameter no rank used keeps ``grad=None``."""
        n = buf.numel() - len(params)
        used = buf[n:].tolist()
        offset = 0
        for i, p in enumerate(params):
            total = buf[offset : offset + p.numel()].view_as(p)  # (numel,) -> p.shape
            offset += p.numel()
            if used[i] == 0:
                p.grad = None
            elif p.grad is None:
                p.grad = total / self.world_size
            else:  # divide while copying back: one pass over the gradient, not two
                torch.div(total, self.world_size, out=p.grad)
        self.elements_reduced += buf.numel() - len(params)

    def reduce_now(self, buf: torch.Tensor, name: str) -> None:
        """A blocking all-reduce, recorded on the timeline."""
        start = self.now()
        self.allreduce_fn(buf, self.group)
        if self.record_events:
            self.events.append(Event("allreduce", name, start, self.now()))

    def start_allreduce(self, buf: torch.Tensor, name: str) -> Pending:
        """Start an all-reduce of ``buf`` without waiting; ``.wait()`` on the result finishes it.

        With torch's collective this is ``async_op=True``: gloo runs it on its own threads
        (NCCL on its own CUDA stream) while backward goes on. A custom ``allreduce_fn`` is
        blocking, so it runs on one background thread: a FIFO "communication stream" that
        keeps the order of collectives identical on every rank.
        """
        event = Event("allreduce", name, self.now(), float("nan"))
        if self.record_events:
            self.events.append(event)

        def done(*_: Any) -> None:
            event.end = self.now()

        if not self.custom_allreduce:
            work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            assert work is not None
            if self.record_events:
                work.get_future().add_done_callback(done)
            return Pending(work.wait, event, self)
        if self._comm_thread is None:
            self._comm_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="labkit-comm")
        future = self._comm_thread.submit(self.allreduce_fn, buf, self.group)
        if self.record_events:
            future.add_done_callback(done)
        return Pending(future.result, event, self)

    def extra_repr(self) -> str:
        return f"world_size={self.world_size}, params={len(self.params)}"


class Pending:
    """A started all-reduce; :meth:`wait` blocks until the buffer holds the sum."""

    def __init__(self, wait: Callable[[], Any], event: Event, owner: DataParallel):
        self._wait, self.event, self._owner = wait, event, owner

    def wait(self) -> None:
        self._wait()
        if self.event.end != self.event.end:  # NaN: the completion callback has not run yet
            self.event.end = self._owner.now()
