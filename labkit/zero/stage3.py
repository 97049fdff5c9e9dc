"""ZeRO-3: shard the parameters too ("P_os+g+p"), the algorithm behind FSDP.

Each rank keeps only its 1/N shard of every unit's parameters. A unit's full parameters
exist only while a module that uses them runs::

    forward  pre-hook : all-gather the unit            (Psi over the whole forward)
    forward  post-hook: free it
    backward pre-hook : all-gather it again            (Psi over the whole backward)
    grads ready       : reduce-scatter into my grad shard, free the unit   (Psi)
    step              : AdamW on my shard; nothing to gather (the next forward does it)

Communication: 3Psi per step, 1.5x DDP's 2Psi. Memory: (4 + 4 + 8) Psi / N plus the units
alive at one time (one, or two with prefetching).

Freeing really frees only if autograd does not keep the gathered parameters alive: ops like
``x @ W.t()`` save ``W`` for backward. A ``saved_tensors_hooks`` pair swaps any saved view of
a gathered buffer for a recipe ``(unit, offset, size, stride)`` and rebuilds the view from
the re-gathered buffer in backward.

``prefetch=True`` (the optimised variant) issues the all-gather of the next module's units
asynchronously (forward order, reversed in backward), so communication overlaps compute, at
the price of two units alive instead of one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from labkit.zero.partition import param_views
from labkit.zero.stage1 import Unit
from labkit.zero.stage2 import ZeRO2

__all__ = ["ZeRO3"]

class ZeRO3(ZeRO2):
    """AdamW with optimizer state, gradients and parameters sharded over ``group``."""

    def __init__(self, model: nn.Module, *args: Any, prefetch: bool = False, **kwargs: Any) -> None:
        self.prefetch = prefetch
        dtype = kwargs.get("param_dtype", torch.float32)
        self._freed = torch.empty(0, dtype=dtype, device=next(iter(model.parameters())).device)
        self._pending: dict[Unit, Any] = {}  # unit -> async all-gather handle
        self._by_storage: dict[int, Unit] = {}  # id(gathered storage) -> unit
        self._order: list[nn.Module] = []  # modules in forward order (recorded once)
        self._recording = True
        super().__init__(model, *args, **kwargs)
        self._needs = self._units_needed_by_module(model)
        for mod in self._needs:
            mod.register_forward_pre_hook(self._pre_forward)
            mod.register_forward_hook(self._post_forward)
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        model.register_forward_pre_hook(lambda m, a: self._saved_hooks.__enter__(), prepend=True)
        model.register_forward_hook(lambda m, a, o: self._end_forward())

    def _build(self, u: Unit) -> None:
        super()._build(u)
        assert u.flat is not None
        lo, hi = u.layout.shard_range(self.rank)
        with self.memory.category("parameters"):
            u.shard = u.flat[lo:hi].clone()  # my parameters, own storage: the full buffer goes
        if self.param_dtype == torch.float32:
            u.master = u.shard
        self._free(u)

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
    def _start_gather(self, u: Unit) -> None:
        if u.flat is not None or u in self._pending:
            return
        buf = self._zeros(u.layout.padded, "temporaries", self.param_dtype)
        self._pending[u] = (buf, self.comm.all_gather(buf, u.shard, async_op=self.prefetch))

    def _gather(self, u: Unit) -> None:
        self._start_gather(u)
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
                self._start_gather(u)

    # ----------------------------------------------------------------- module hooks
    def _pre_forward(self, mod: nn.Module, args: Any) -> None:
        if self._recording and mod not in self._order:
            self._order.append(mod)
        for u in self._needs[mod]:
            self._gather(u)
        self._prefetch_after(mod, backward=False)

    def _post_forward(self, mod: nn.Module, args: Any, out: Any) -> None:
        for u in self._needs[mod]:
            self._free(u)
        if torch.is_grad_enabled():
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda g, mod=mod: self._pre_backward(mod))

    def _pre_backward(self, mod: nn.Module) -> None:
        for u in self._needs[mod]:
            self._gather(u)
        self._prefetch_after(mod, backward=True)

    def _end_forward(self) -> None:
        self._saved_hooks.__exit__(None, None, None)
        self._recording = False

    def _after_reduce(self, u: Unit) -> None:
        self._free(u)  # its gradients are reduced: backward needs it no more

    def _flush(self) -> None:
        super()._flush()
        for u in self.units:  # gathered for a backward that produced no gradient for it
            self._free(u)

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
        self._gather(u)  # normally already gathered by the backward pre-hook
        assert u.flat is not None
        return u.flat.as_strided(shape, stride, offset)

    # ----------------------------------------------------------------- step
    def _publish(self, u: Unit) -> None:
        return None  # the shard was updated in place; the next forward gathers it

    def _gather_full(self, shard: torch.Tensor, u: Unit) -> torch.Tensor:
        full = torch.empty(u.layout.padded, device=shard.device)
        self.comm.all_gather(full, shard.contiguous())
        return full
