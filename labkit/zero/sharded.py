"""What every ZeRO stage shares: AdamW on this rank's shard of flat parameter buffers.

A stage decides three things: which gradients a rank keeps (all of them, or its shard), when
they are reduced (at ``step``, or during backward), and whether the full parameters stay
(stages 0-2) or are gathered only while a module runs (stage 3). Everything else lives here,
once, in :class:`ShardedAdamW`, which each stage extends by one level and calls explicitly (it
has no hooks for a stage to override):

* the units (:func:`~labkit.zero.partition.make_units`) and their flat parameters, identical
  on every rank at the start;
* the optimizer state of this rank's shard: the fp32 master weights
  (:class:`labkit.precision.mixed.PrecisionPolicy`) and Adam's two moments;
* :meth:`ShardedAdamW.apply_step`: agree which parameters any rank used, let a
  :class:`~labkit.precision.DynamicLossScaler` skip the step on inf/nan, then AdamW on the
  shard and round it into the compute copy;
* :meth:`ShardedAdamW.full_state_dict`: consolidation for tests and checkpoints.

Unused parameters. ``torch.optim.AdamW`` skips a parameter whose ``.grad`` is None: no update,
no weight decay, no moment decay, no step count. With data parallelism "None" means that *no
rank* produced a gradient for it in any micro-batch of the step, so every rank marks the
parameters autograd gave a gradient (a post-accumulate-grad hook), and one small all-reduce
of those flags per step counts the users (DDP carries the same flags, see
:mod:`labkit.ddp.base`). A parameter with count 0 keeps its value, moments and step count; a
parameter used by some ranks only is averaged over all of them, zeros from the others, as
the full-batch gradient is.

Communication goes through :class:`labkit.collectives.comm.Comm` only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from types import SimpleNamespace
from typing import Protocol, cast

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from labkit.collectives.comm import Comm
from labkit.precision.loss_scaler import DynamicLossScaler
from labkit.precision.mixed import PrecisionPolicy
from labkit.zero.adam import AdamConfig, adamw_
from labkit.zero.partition import Piece, Unit, flatten_into, make_units, param_views

__all__ = ["Ledger", "ShardedAdamW", "adopt_grads"]


class Ledger(Protocol):
    """Where ZeRO files its buffers: :class:`labkit.memory.MemoryTracker` fits."""

    def register(self, tensors: torch.Tensor, category: str) -> None: ...

    def category(self, name: str) -> AbstractContextManager[None]: ...


class _NoLedger:
    def register(self, tensors: torch.Tensor, category: str) -> None:
        return None

    def category(self, name: str) -> AbstractContextManager[None]:
        return nullcontext()


@torch.no_grad()
def adopt_grads(u: Unit) -> None:
    """Make every ``p.grad`` a view into the flat gradient buffer ``u.grad`` (padded,), so that
    autograd accumulates in place into it. A ``p.grad`` someone replaced (``model.zero_grad()``
    sets None) is copied in (or zeroed) first."""
    for p, view in zip(u.params, param_views(u.grad, u.layout, u.shapes)):
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        p.grad = view


class ShardedAdamW:
    """The units of ``model`` as flat buffers, with AdamW state for this rank's shard of each
    (``shard_optimizer=True``) or for all of it (stage 0, the DDP baseline)."""

    def __init__(
        self,
        model: nn.Module,
        cfg: AdamConfig | None = None,
        *,
        group: ProcessGroup | None = None,
        comm_impl: str = "torch",
        wrap: Sequence[nn.Module] | None = None,
        param_dtype: torch.dtype = torch.float32,
        scaler: DynamicLossScaler | None = None,
        memory: Ledger | None = None,
        shard_optimizer: bool = True,
    ) -> None:
        self.policy = PrecisionPolicy(param_dtype)  # validates before any communication
        self.param_dtype = param_dtype
        self.model = model
        self.cfg = cfg or AdamConfig()
        self.comm = Comm(group, comm_impl)
        self.group = group
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.scaler = scaler
        self.memory: Ledger = memory or _NoLedger()
        self.device = next(iter(model.parameters())).device
        self.step_count = 0
        self.units = make_units(model, self.world_size, wrap)
        self.pieces: dict[Unit, list[Piece]] = {}  # what this rank's optimizer updates
        for u in self.units:
            self._build(u, shard_optimizer)
        model.to(param_dtype)  # frozen parameters and buffers (managed ones already are)
        # "used" flags: one per managed parameter, set by autograd, summed over ranks at step
        self._index = {id(p): i for i, p in enumerate(self.managed())}
        self._used = [False] * len(self._index)
        for p in self.managed():
            p.register_post_accumulate_grad_hook(self._mark_used)

    # ----------------------------------------------------------------- construction
    def zeros(self, n: int, category: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zeroed (n,) buffer on the model's device, filed under ``category``."""
        with self.memory.category(category):
            return torch.zeros(n, dtype=dtype, device=self.device)

    def _build(self, u: Unit, shard_optimizer: bool) -> None:
        """Full parameters in the compute dtype (every rank starts from rank 0's), the fp32
        master and Adam's moments of this rank's range."""
        full32 = self.zeros(u.layout.padded, "temporaries")
        if self.rank == 0:  # the others add zeros: the SUM is rank 0's values, exactly
            flatten_into(full32, u.layout, [p.detach() for p in u.params])
        self.comm.all_reduce(full32)
        if shard_optimizer:
            lo, hi = u.layout.shard_range(self.rank)
            self.pieces[u] = u.layout.pieces(self.rank)
        else:  # every rank updates every element: each parameter is one whole piece
            lo, hi = 0, u.layout.padded
            self.pieces[u] = [
                Piece(i, self.rank, 0, off, n)
                for i, (off, n) in enumerate(zip(u.layout.offsets, u.layout.numels))
            ]
        if self.policy.keeps_master:  # a 16-bit compute copy, an fp32 master of my range
            u.flat = self.zeros(u.layout.padded, "parameters", self.param_dtype).copy_(full32)
            with self.memory.category("optimizer_state"):
                u.master = self.policy.master_of(full32[lo:hi])
        else:  # fp32: the parameters are their own master copy
            u.flat = full32
            self.memory.register(u.flat, "parameters")
        for p, view in zip(u.params, param_views(u.flat, u.layout, u.shapes)):
            p.data = view  # the module now computes with a view into the flat buffer
        u.shard = u.flat[lo:hi]  # my parameters: a view, so an all-gather's output updates them
        if not self.policy.keeps_master:
            u.master = u.shard
        u.exp_avg = self.zeros(hi - lo, "optimizer_state")
        u.exp_avg_sq = self.zeros(hi - lo, "optimizer_state")
        u.steps = [0] * len(u.params)

    def _mark_used(self, p: nn.Parameter) -> None:
        self._used[self._index[id(p)]] = True

    # ----------------------------------------------------------------- gradients
    def zero_grad(self) -> None:
        for u in self.units:
            u.grad.zero_()

    @torch.no_grad()
    def reduce_scatter_grads(self, u: Unit) -> None:
        """Autograd's gradients of ``u`` -> one reduce-scatter -> added to my gradient shard
        ``u.grad``; ``p.grad`` dropped (stages 2 and 3, during backward)."""
        buf = self.zeros(u.layout.padded, "temporaries", self.param_dtype)  # what is sent
        flatten_into(buf, u.layout, [p.grad for p in u.params])  # None (not used here) -> 0
        for p in u.params:
            p.grad = None
        mine = self.zeros(u.layout.shard_size, "temporaries", self.param_dtype)
        self.comm.reduce_scatter(mine, buf)  # (padded,) -> (shard_size,), summed over ranks
        del buf
        u.grad.add_(mine)  # accumulate over micro-batches

    # ----------------------------------------------------------------- the step
    def step(self) -> bool:
        """Each stage writes its own: reduce the gradients its way, then :meth:`apply_step`."""
        raise NotImplementedError(f"{type(self).__name__} does not define step()")

    @torch.no_grad()
    def apply_step(
        self,
        grad_of: Callable[[Unit], torch.Tensor],
        publish: Callable[[Unit], None] | None = None,
    ) -> bool:
        """AdamW on every unit's master range; ``grad_of(u)`` gives unit ``u``'s averaged fp32
        gradient for that range, ``publish(u)`` runs after ``u`` is updated. One unit at a
        time, so one unit's gradient temporaries at most, unless a loss scaler must see every
        gradient first. Returns False when the loss scaler skipped the step."""
        used = torch.tensor(self._used, dtype=torch.float32, device=self.device)
        self.comm.all_reduce(used)  # how many ranks used each parameter (0: leave it alone)
        self._used = [False] * len(self._used)
        counts, first, used_by_unit = used.tolist(), 0, {}
        for u in self.units:
            used_by_unit[u] = [c > 0 for c in counts[first : first + len(u.params)]]
            first += len(u.params)

        if self.scaler is None:
            self.step_count += 1
            for u in self.units:
                self._adamw(u, grad_of(u), used_by_unit[u])
                if publish is not None:
                    publish(u)
            return True
        grads = {u: grad_of(u) for u in self.units}

        def update() -> None:
            self.step_count += 1
            for u in self.units:
                self._adamw(u, grads[u], used_by_unit[u])

        # DynamicLossScaler.step reads an optimizer's param_groups[*]["params"][*].grad, then
        # calls its step(): hand it the fp32 gradient shards (it unscales them in place)
        holders = [SimpleNamespace(grad=g) for g in grads.values()]
        as_optimizer = SimpleNamespace(param_groups=[{"params": holders}], step=update)
        took = self.scaler.step(cast(Optimizer, as_optimizer))
        self.scaler.update()
        if took and publish is not None:
            for u in self.units:
                publish(u)
        return took

    def _adamw(self, u: Unit, grad: torch.Tensor, used: list[bool]) -> None:
        for i, is_used in enumerate(used):
            u.steps[i] += is_used
        mine = [pc for pc in self.pieces[u] if used[pc.param]]
        if len(mine) == len(self.pieces[u]) and len({u.steps[pc.param] for pc in mine}) <= 1:
            step = u.steps[mine[0].param] if mine else 1
            adamw_(u.master, grad, u.exp_avg, u.exp_avg_sq, step, self.cfg)  # one call: usual
        else:  # some parameter unused (or with its own step count): update piece by piece
            for pc in mine:
                s = slice(pc.shard_start, pc.shard_start + pc.length)
                adamw_(
                    u.master[s], grad[s], u.exp_avg[s], u.exp_avg_sq[s], u.steps[pc.param], self.cfg
                )
        self.policy.master_to_model(u.master, u.shard)

    @torch.no_grad()
    def all_gather_params(self, u: Unit) -> None:
        """Every rank's updated shard of ``u`` into every rank's full parameters (stages 1-2)."""
        assert u.flat is not None
        self.comm.all_gather(u.flat, u.shard.clone())  # clone: the input must not alias output

    # ----------------------------------------------------------------- inspection
    def _full(self, tensor: torch.Tensor, u: Unit) -> torch.Tensor:
        """Every rank's ``tensor`` (this rank's range of unit ``u``) end to end, (padded,)."""
        if tensor.numel() == u.layout.padded:
            return tensor.float()
        full = torch.empty(u.layout.padded, dtype=tensor.dtype, device=tensor.device)
        self.comm.all_gather(full, tensor.contiguous())
        return full.float()

    def full_state_dict(self) -> dict[str, dict[str, torch.Tensor]] | None:
        """Consolidate on rank 0 (collective: every rank must call it): ``{"params", "exp_avg",
        "exp_avg_sq"}`` each ``{name: full tensor}``, plus ``step``. Other ranks get None."""
        out: dict[str, dict[str, torch.Tensor]] = {"params": {}, "exp_avg": {}, "exp_avg_sq": {}}
        for u in self.units:
            for key, mine in (
                ("params", u.master),
                ("exp_avg", u.exp_avg),
                ("exp_avg_sq", u.exp_avg_sq),
            ):
                full = self._full(mine, u)
                for name, view in zip(u.names, param_views(full, u.layout, u.shapes)):
                    out[key][name] = view.clone()
        out["step"] = {"step": torch.tensor(self.step_count)}
        return out if self.rank == 0 else None

    def managed(self) -> list[nn.Parameter]:
        return [p for u in self.units for p in u.params]

    @property
    def num_params(self) -> int:
        """Psi: the trainable parameters managed (frozen ones excluded, padding excluded)."""
        return sum(u.layout.total for u in self.units)
