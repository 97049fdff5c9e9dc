"""ZeRO-3: shard the parameters too (Rajbhandari et al. 2019, "P_os+g+p"), as FSDP FULL_SHARD.

Each rank keeps only its 1/N shard of every unit's parameters. A unit's full parameters
exist only while a module that uses them runs::

    forward  pre-hook : all-gather the unit            (Psi over the whole forward)
    forward  post-hook: free it (the root module's unit, if any: at the end of backward)
    backward pre-hook : all-gather it again            (Psi over the whole backward)
    module's backward done: reduce-scatter into my grad shard, free it (Psi)
    step              : AdamW on my shard; nothing to gather (the next forward does it)

Communication: 3Psi per step (less the root's unit, gathered once), 1.5x DDP's 2Psi. Memory:
(4 + 4 + 8) Psi / N plus the units alive at one time (one, or two with prefetching).

Freeing really frees only if autograd does not keep the gathered parameters alive: ops like
``x @ W.t()`` save ``W`` for backward. A ``saved_tensors_hooks`` pair swaps any saved view of
a gathered buffer for a recipe ``(unit, offset, size, stride)`` and rebuilds the view from
the re-gathered buffer in backward.

``prefetch=True`` (the optimised variant) issues the all-gather of the next module's units
asynchronously (forward order, reversed in backward), so communication overlaps compute, at
the price of two units alive instead of one.

Gradients are reduce-scattered as in ZeRO-2, and the unit freed, when the backward of the
last module that used the unit in this step is done (FSDP2's post-backward): an identity
``autograd.Function`` on the module's inputs runs after the module's backward. That moment
is the same on every rank when every rank runs the same modules, even where one rank's
module produced no gradient for some parameter; "all gradients produced" (ZeRO-2's trigger)
is not, and here gathers interleave with the reduce-scatters, so a fixed reduce order alone
would not pair them. :class:`labkit.zero.backward.BackwardReducer` flushes the rest (units
whose module inputs need no gradient, e.g. the token embedding) at the end of backward,
with zeros from ranks that produced none.

Activation checkpointing (:mod:`labkit.activation_checkpoint`): a checkpointed block's
forward runs again inside backward. Its modules gather their units there (the forward's
copies were freed); a post-forward hook running *inside backward* keeps them, so the
backward pre-hook finds them gathered. Collectives per step stay those of a plain step.

What ZeRO-3 (and FSDP) require of control flow. The all-gathers are issued from module
hooks, in forward and in backward, and collectives pair up by order. So every rank must run
the same modules' forwards in the same order, and backward must reach the output of every
module on every rank whenever it reaches it on one (FSDP's all-gathers come from the same
two places and require the same). What may differ per rank is which *parameters* get
gradients: a module that runs on every rank may leave some or all of its parameters without
a gradient on some ranks; its unit is still reduced when the module's backward ends, zeros
from those ranks, and a parameter no rank used is skipped as AdamW skips it. A layer that
one rank does not call at all mismatches the collectives here, while stages 1-2 allow it.
The first forward and backward check it (:class:`labkit.zero.lockstep.LockstepCheck`: one
small all-gather before each collective of the first step): a module one rank ran and
another skipped raises the same ValueError on every rank, naming it, instead of a gloo
abort or an NCCL hang.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from labkit.zero.adam import AdamConfig
from labkit.zero.backward import BackwardReducer
from labkit.zero.lockstep import GATHER, REDUCE, LockstepCheck
from labkit.zero.partition import Unit, param_views
from labkit.zero.sharded import ShardedAdamW

__all__ = ["ZeRO3"]


def _in_backward() -> bool:
    """True while autograd's engine runs a backward on this thread (checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


class ZeRO3(ShardedAdamW):
    """AdamW with optimizer state, gradients and parameters sharded over ``group``.
    ``prefetch``: all-gather the next module's units ahead. Other keyword arguments: see
    :class:`ShardedAdamW`."""

    def __init__(
        self,
        model: nn.Module,
        cfg: AdamConfig | None = None,
        *,
        prefetch: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, cfg, shard_optimizer=True, **kwargs)
        self.prefetch = prefetch
        self._lockstep = LockstepCheck(model, self.units, self.group, self.device)
        self._in_forward = False  # the saved-tensor hooks are pushed (see _begin_forward)
        self._freed = torch.empty(0, dtype=self.param_dtype, device=self.device)
        self._pending: dict[Unit, Any] = {}  # unit -> (buffer, async all-gather handle)
        self._by_storage: dict[int, Unit] = {}  # id(gathered storage) -> unit
        self._order: list[nn.Module] = []  # modules in forward order (recorded once)
        self._recording = True
        for u in self.units:
            assert u.flat is not None
            lo, hi = u.layout.shard_range(self.rank)
            with self.memory.category("parameters"):
                u.shard = u.flat[lo:hi].clone()  # my parameters, own storage: the full one goes
            if not self.policy.keeps_master:
                u.master = u.shard
            u.grad = self.zeros(u.layout.shard_size, "gradients", self.param_dtype)
            self._free(u)
        self._uses = dict.fromkeys(self.units, 0)  # forward uses whose backward is still ahead
        self.reducer = BackwardReducer(
            model,
            self.units,
            self._reduce_and_free,
            when="caller",
            after_flush=self._after_backward,
        )
        self._needs = self._units_needed_by_module(model)
        for mod in self._needs:
            mod.register_forward_pre_hook(self._pre_forward)
            mod.register_forward_hook(self._post_forward)
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        model.register_forward_pre_hook(lambda m, a: self._begin_forward(), prepend=True)
        model.register_forward_hook(lambda m, a, o: self._end_forward())

    def _units_needed_by_module(self, model: nn.Module) -> dict[nn.Module, list[Unit]]:
        """A module gathers the units it owns, plus the unit of any parameter it uses directly
        whose owner is not itself or an enclosing module (a tied weight owned elsewhere)."""
        ancestors: dict[nn.Module, set[int]] = {}
        for mod in model.modules():
            ancestors.setdefault(mod, {id(mod)})
            for child in mod.children():
                ancestors.setdefault(child, ancestors[mod] | {id(child)})
        unit_of = {id(p): u for u in self.units for p in u.params}
        needs: dict[nn.Module, list[Unit]] = {}
        for mod in model.modules():
            units = [u for u in self.units if u.owner is mod]
            for p in mod.parameters(recurse=False):
                u = unit_of.get(id(p))
                if u is not None and id(u.owner) not in ancestors[mod] and u not in units:
                    units.append(u)
            if units:
                needs[mod] = units
        return needs

    # ----------------------------------------------------------------- gather / free
    def _check(self, kind: int, u: Unit, mod: nn.Module) -> None:
        """First step only: compare this collective with every rank's (see lockstep.py). On a
        mismatch every rank raises; this rank's forward state is unwound first, so the
        process stays usable (no collective was left unmatched)."""
        try:
            self._lockstep.before(kind, u, mod, _in_backward())
        except ValueError:
            if self._in_forward:
                self._end_forward()
            raise

    def _start_gather(self, u: Unit, mod: nn.Module) -> None:
        if u.flat is not None or u in self._pending:
            return
        self._check(GATHER, u, mod)
        buf = self.zeros(u.layout.padded, "temporaries", self.param_dtype)
        self._pending[u] = (buf, self.comm.all_gather(buf, u.shard, async_op=self.prefetch))

    def _gather(self, u: Unit, mod: nn.Module) -> None:
        self._start_gather(u, mod)
        if u in self._pending:
            buf, work = self._pending.pop(u)
            work.wait()
            u.flat = buf
            self._by_storage[id(buf.untyped_storage())] = u
            for p, view in zip(u.params, param_views(buf, u.layout, u.shapes)):
                p.data = view

    def _free(self, u: Unit) -> None:
        if u in self._pending:
            self._pending.pop(u)[1].wait()
        if u.flat is not None:
            self._by_storage.pop(id(u.flat.untyped_storage()), None)
            u.flat = None
        for p in u.params:
            p.data = self._freed

    def _prefetch_after(self, mod: nn.Module, backward: bool) -> None:
        if not self.prefetch or self._recording or mod not in self._order:
            return
        i = self._order.index(mod) + (-1 if backward else 1)
        if 0 <= i < len(self._order):
            for u in self._needs[self._order[i]]:
                self._start_gather(u, self._order[i])

    # ----------------------------------------------------------------- module hooks
    def _pre_forward(self, mod: nn.Module, args: Any) -> Any:
        if self._recording and mod not in self._order:
            self._order.append(mod)
        for u in self._needs[mod]:
            self._gather(u, mod)
        if not _in_backward():  # a recompute runs only this block: prefetch nothing beyond
            self._prefetch_after(mod, backward=False)
        if not torch.is_grad_enabled():
            return None
        for u in self._needs[mod]:
            self._uses[u] += 1
        # the end of this module's backward reduces its units: a moment all ranks share when
        # they run the same modules (unlike "all gradients produced", see the docstring)
        grad_args = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        if not grad_args:  # e.g. token ids: the flush at the end of backward reduces it
            return None
        marked = iter(_PostBackward.apply(lambda: self._post_backward(mod), *grad_args))
        return tuple(
            next(marked) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args
        )

    def _post_forward(self, mod: nn.Module, args: Any, out: Any) -> None:
        # in a recompute, keep the unit: its backward comes next. The root's unit stays until
        # the end of backward (FSDP2's root does too): its backward pre-hook sits on the output,
        # a child's output on one rank (child's hook first) and not on another (root first):
        # gathering it there again would order the all-gathers differently per rank.
        if not _in_backward() and not (mod is self.model and torch.is_grad_enabled()):
            for u in self._needs[mod]:
                self._free(u)
        if torch.is_grad_enabled():
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda g, mod=mod: self._pre_backward(mod))

    def _pre_backward(self, mod: nn.Module) -> None:
        for u in self._needs[mod]:
            self._gather(u, mod)
        self._prefetch_after(mod, backward=True)

    def _begin_forward(self) -> None:
        self._saved_hooks.__enter__()
        self._in_forward = True

    def _end_forward(self) -> None:
        self._saved_hooks.__exit__(None, None, None)
        self._in_forward = False
        self._recording = False

    # ----------------------------------------------------------------- saved tensors
    def _pack(self, t: torch.Tensor) -> Any:
        u = self._by_storage.get(id(t.untyped_storage()))
        if u is None:
            return t  # an activation: keep it
        return (u, t.storage_offset(), tuple(t.shape), t.stride())  # a recipe, not the buffer

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        u, offset, shape, stride = packed
        self._gather(u, u.owner)  # normally already gathered by the backward pre-hook
        assert u.flat is not None
        return u.flat.as_strided(shape, stride, offset)

    # ----------------------------------------------------------------- gradients, step
    def _post_backward(self, mod: nn.Module) -> None:
        """``mod``'s backward is done: a unit whose every use in this step is done goes."""
        for u in self._needs[mod]:
            self._uses[u] -= 1
            if self._uses[u] < 0:
                raise RuntimeError(
                    f"unit {u.names} got more backward passes than forward uses: a parameter "
                    "used inside and outside a checkpointed block?"
                )
            if self._uses[u] == 0:
                self.reducer.reduce_now(u)

    def _reduce_and_free(self, u: Unit) -> None:
        self._check(REDUCE, u, u.owner)
        self.reduce_scatter_grads(u)
        self._free(u)  # its gradients are reduced: backward needs it no more

    def _after_backward(self) -> None:
        self._lockstep.end()  # after the flush's reduce-scatters: the first step's last record
        for u in self.units:  # gathered for a backward that produced no gradient for them
            self._free(u)
            self._uses[u] = 0
            if any(p.grad is not None for p in u.params):
                raise RuntimeError(f"a gradient of {u.names} arrived after its unit was reduced")

    @torch.no_grad()
    def step(self) -> bool:
        """AdamW on my shard; the next forward gathers it. False when the scaler skipped."""
        for u in self.units:  # a forward without backward may have left the root's unit
            self._free(u)
        return self.apply_step(lambda u: self.policy.grad_to_master(u.grad, self.world_size))


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward runs once the module's backward is done
    (autograd runs it after every node the module created, and parameter gradients are
    accumulated as soon as they are produced). FSDP2 uses the same device."""

    @staticmethod
    def forward(ctx: Any, callback: Any, *inputs: torch.Tensor) -> Any:
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.callback()
        return (None, *grads)
