"""What every data-parallel variant shares: the wrapper, the gradient buffer, the collectives.

Data parallelism (DDP) in one invariant: *after the gradient sync, every rank holds the
gradient of the mean loss over the union of all ranks' micro-batches*, i.e.::

    grad = (1 / world_size) * sum_r grad_r        where grad_r = d mean_loss(x_r) / d params

so that one optimizer step on any rank equals one step of single-process training on the
full batch. The parameters start identical (rank 0's are broadcast) and every rank applies
the same update, so they stay bit-identical on every rank forever.

The timeline each wrapper can record (:class:`Event`, :class:`Pending`) is in ``events.py``.

The variants differ only in *how* the sum is communicated; each one is a file that reads
alone, defining its own ``finish_gradient_sync()`` from the pieces below:

=============  ====================================================  ======================
module         communication                                          collectives per step
=============  ====================================================  ======================
naive.py       one all-reduce per parameter, after backward           num_params + 1
flat.py        all gradients in one contiguous buffer, one all-reduce 1
bucketed.py    buffers of ``bucket_cap_mb``, reverse order of use     num_buckets
overlapped.py  the same buckets, launched from gradient hooks         num_buckets (hidden)
=============  ====================================================  ======================

Usage, the same for all of them (and close to ``torch.nn.parallel.DistributedDataParallel``)::

    model = OverlappedDDP(net, group=None, bucket_cap_mb=1.0)   # comm=Comm(group, impl="ring")
    for i, (x, y) in enumerate(batches):
        with model.no_sync() if (i + 1) % accum else contextlib.nullcontext():
            (loss_fn(model(x), y) / accum).backward()
        if (i + 1) % accum == 0:
            model.finish_gradient_sync()   # torch DDP hides this inside backward()
            opt.step(); opt.zero_grad(set_to_none=True)

Communication goes through a :class:`labkit.collectives.Comm`: ``Comm(group)`` is PyTorch's
all-reduce, ``Comm(group, impl="ring")`` labkit's own ring; the wrapper never calls
``torch.distributed`` collectives directly (only the start-up broadcast).

Compression: ``OverlappedDDP(net, compression=PowerSGD(rank=2))`` (or ``Fp16Compression()``,
any variant) hands each packed buffer to :mod:`labkit.ddp.compression` instead of the plain
all-reduce; it still communicates only through ``self.comm`` and returns the *mean*.

Awkward parameters, handled by every variant:

* **frozen** (``requires_grad=False``): broadcast at start, never reduced.
* **tied** (one ``Parameter`` reachable twice, e.g. GPT's embedding and head): autograd sums
  both uses into one ``.grad``; it is listed and reduced *once* (``parameters()``
  de-duplicates by identity).
* **no gradient in a step** (a branch not taken): another rank may have taken it, so every
  rank still takes part in the collective, contributing zeros. One extra "used" flag per
  parameter travels in the same buffer; a parameter no rank used keeps ``grad=None``, so the
  optimizer skips it exactly as in single-process training (momentum and weight decay
  would otherwise move it).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed import ProcessGroup

from labkit.collectives.comm import Comm
from labkit.ddp.compression import Compression
from labkit.ddp.events import Event, Pending
from labkit.parallel.layout import global_rank


class DataParallel(nn.Module):
    """The wrapper the variants build on: broadcast, ``forward``, ``no_sync``, buffers, clock.

    ``group``: the process group the gradients are averaged over (None = WORLD).
    ``comm``: the collectives used (default ``Comm(group)``, PyTorch's); its group must be
    ``group``. ``record_events``: keep a timeline of the last step in :attr:`events` (host
    clock; on CUDA the all-reduce ends are completion callbacks). ``compression``: a
    :class:`~labkit.ddp.compression.Compression` (one per wrapper) that averages each buffer
    in fewer bytes, or None for the exact all-reduce. A variant adds one method,
    ``finish_gradient_sync()``: average the gradients; call it after the last backward.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        group: ProcessGroup | None = None,
        comm: Comm | None = None,
        record_events: bool = False,
        compression: Compression | None = None,
    ):
        super().__init__()
        if compression is not None and not isinstance(compression, Compression):
            raise TypeError(
                "compression must be a labkit.ddp.compression.Compression (Fp16Compression(), "
                f"PowerSGD(...)) or None, got {compression!r}"
            )
        if not dist.is_initialized():
            raise RuntimeError(
                f"{type(self).__name__} needs torch.distributed initialised "
                "(run it inside labkit.launch(...) or torchrun)"
            )
        if comm is not None and not isinstance(comm, Comm):
            raise TypeError(f"comm must be a labkit.collectives.Comm, got {comm!r}")
        if comm is not None and group is not None and comm.group is not group:
            raise ValueError(f"comm runs over group {comm.group!r}, but group={group!r} was passed")
        self.comm = comm if comm is not None else Comm(group)
        self.module = module
        self.group = self.comm.group
        self.world_size = dist.get_world_size(self.group)
        self.record_events = record_events
        self.compression = compression
        self.events: list[Event] = []
        self.elements_reduced = 0  # summed over the last sync: proves tied weights go once
        self.require_sync = True
        self._t0 = time.perf_counter()
        self._comm_thread: ThreadPoolExecutor | None = None
        self._comm_buffers: dict[tuple[int, ...], tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._buffer_params: dict[int, list[nn.Parameter]] = {}  # id(buffer) -> what it packs

        # The trainable parameters, each once, in registration order (~ order of use in
        # forward). Frozen ones are broadcast but never reduced.
        self.params: list[nn.Parameter] = [p for p in module.parameters() if p.requires_grad]
        self.names: dict[int, str] = {id(p): n for n, p in module.named_parameters()}
        kinds = {(p.dtype, p.device) for p in self.params}
        if len(kinds) > 1:
            raise ValueError(
                "all trainable parameters must share one dtype and device to share a buffer, "
                f"got {sorted(str(k) for k in kinds)}"
            )
        self._broadcast_from_rank0()

    def _broadcast_from_rank0(self) -> None:
        """Every rank starts from rank 0's parameters and buffers (frozen ones included)."""
        with torch.no_grad():
            for t in [*self.module.parameters(), *self.module.buffers()]:
                dist.broadcast(t.data, src=global_rank(self.group, 0), group=self.group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        record = self.record_events and self.require_sync  # the step's last micro-batch
        if record:
            self.events = []
            self._t0 = time.perf_counter()
        out = self.module(*args, **kwargs)
        if record and isinstance(out, torch.Tensor) and out.requires_grad:
            # The gradient w.r.t. the output is the first thing backward computes.
            out.register_hook(self._record_backward)
        return out

    def _record_backward(self, grad: torch.Tensor) -> None:
        """Backward starts now; a callback queued on the autograd engine marks its end."""
        event = Event("backward", "backward", self.now(), float("nan"))
        self.events.insert(0, event)  # the top row of the timeline

        def end() -> None:
            event.end = self.now()

        Variable._execution_engine.queue_callback(end)

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

    def now(self) -> float:
        """Seconds since this step's ``forward``: the timeline's clock."""
        return time.perf_counter() - self._t0

    # ---- the gradient buffer --------------------------------------------------------------

    def buffer_of(self, params: list[nn.Parameter]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The buffer :meth:`pack` fills for ``params`` and each one's ``(numel,)`` slot in it,
        allocated once and reused: a fresh buffer per step pays page faults."""
        key = tuple(id(p) for p in params)
        if key not in self._comm_buffers:
            n = sum(p.numel() for p in params)
            buf = torch.empty(n + len(params), dtype=params[0].dtype, device=params[0].device)
            ends = list(itertools.accumulate(p.numel() for p in params))
            slots = [buf[end - p.numel() : end] for p, end in zip(params, ends)]
            self._comm_buffers[key] = (buf, slots)
            self._buffer_params[id(buf)] = params
        return self._comm_buffers[key]

    def pack(self, params: list[nn.Parameter]) -> torch.Tensor:
        """``[grad_0.flatten(), ..., grad_k.flatten(), used_0, ..., used_k]`` in one buffer.

        A missing gradient contributes zeros; its ``used`` flag is 0. After the SUM all-reduce
        the flag counts the ranks that used the parameter.
        """
        buf, slots = self.buffer_of(params)
        for i, p in enumerate(params):
            self.put_grad(buf, slots, i, p)
        return buf

    @staticmethod
    def put_grad(
        buf: torch.Tensor, slots: list[torch.Tensor], i: int, p: nn.Parameter, scale: float = 1.0
    ) -> None:
        """``p``'s gradient x ``scale`` into ``slots[i]`` (zeros if none), its used flag too."""
        if p.grad is None:
            slots[i].zero_()
        elif scale == 1.0:
            slots[i].copy_(p.grad.reshape(-1))  # (numel,)
        else:  # in place when .grad already is the slot (overlapped's views, accumulated into)
            torch.mul(p.grad.reshape(-1), scale, out=slots[i])
        buf[buf.numel() - len(slots) + i] = 0.0 if p.grad is None else 1.0

    def unpack(self, buf: torch.Tensor, params: list[nn.Parameter], as_views: bool = False) -> None:
        """Write the averaged gradients back; a parameter no rank used keeps ``grad=None``.

        ``buf`` holds the SUM over ranks, or already the mean (after a compression). With
        ``as_views`` it holds the mean (filled pre-divided, :mod:`~labkit.ddp.overlapped`) and
        each ``.grad`` becomes a view into it instead of a copy of it."""
        divisor = self.world_size if self.compression is None and not as_views else 1
        n = buf.numel() - len(params)
        used = buf[n:].tolist()
        offset = 0
        for i, p in enumerate(params):
            total = buf[offset : offset + p.numel()].view_as(p)  # (numel,) -> p.shape
            offset += p.numel()
            if used[i] == 0:
                p.grad = None
            elif as_views:
                p.grad = total
            elif p.grad is None:
                p.grad = total / divisor
            else:  # divide while copying back: one pass over the gradient, not two
                torch.div(total, divisor, out=p.grad)
        self.elements_reduced += n

    # ---- communication ---------------------------------------------------------------------

    def all_reduce(self, buf: torch.Tensor, name: str) -> None:
        """A blocking SUM all-reduce of ``buf`` through ``self.comm`` (with ``compression``: the
        mean, see :meth:`_reduce`), recorded on the timeline."""
        start = self.now()
        self._reduce(buf)
        if self.record_events:
            self.events.append(Event("allreduce", name, start, self.now()))

    def start_allreduce(self, buf: torch.Tensor, name: str) -> Pending:
        """Start :meth:`all_reduce`'s work on ``buf`` without waiting; ``.wait()`` on the result
        ends it.

        PyTorch's collective (``comm.impl == "torch"``) is asynchronous: gloo runs it on its
        own threads (NCCL on its own CUDA stream) while backward goes on. labkit's ring and
        a compression (collectives with computation between them) are blocking, so they run
        on one background thread: a FIFO "communication stream" that keeps the order of
        collectives identical on every rank.
        """
        event = Event("allreduce", name, self.now(), float("nan"))
        if self.record_events:
            self.events.append(event)

        def done(*_: Any) -> None:
            event.end = self.now()

        if self.comm.impl == "torch" and self.compression is None:
            work = self.comm.all_reduce(buf, async_op=True)
            if self.record_events and hasattr(work, "get_future"):
                work.get_future().add_done_callback(done)
            return Pending(work.wait, event, self.now)
        if self._comm_thread is None:
            self._comm_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="labkit-comm")
        future = self._comm_thread.submit(self._reduce, buf)
        if self.record_events:
            future.add_done_callback(done)
        return Pending(future.result, event, self.now)

    def _reduce(self, buf: torch.Tensor) -> None:
        """Blocking: the SUM all-reduce, or the compression's mean of a buffer from ``pack``."""
        if self.compression is None:
            self.comm.all_reduce(buf)
            return
        params = self._buffer_params.get(id(buf))
        if params is None:
            raise ValueError("with compression, all-reduce only buffers made by self.pack(...)")
        self.compression.all_reduce_mean(buf, params, self.comm)

    def extra_repr(self) -> str:
        extra = "" if self.compression is None else f", compression={self.compression!r}"
        return (
            f"world_size={self.world_size}, params={len(self.params)}, comm={self.comm.impl}"
            + extra
        )
