"""ZeRO-1: shard the optimizer state (Rajbhandari et al. 2019, "P_os").

Every rank keeps the full parameters and full gradients, but Adam's two fp32 moments only
for its 1/N shard of a flat buffer (:mod:`labkit.zero.partition`). One step::

    grads (full, every rank) --reduce-scatter--> my averaged grad shard     sends (N-1)/N Psi
    AdamW on my shard only (params, m, v of my shard)                       K Psi / N memory
    my updated param shard --all-gather--> full params on every rank        sends (N-1)/N Psi

Communication: a reduce-scatter plus an all-gather is exactly what a ring all-reduce does
internally, so ZeRO-1 costs the same 2Psi per rank as DDP while cutting the optimizer state
from K Psi to K Psi / N. Memory per rank: 4Psi params + 4Psi grads + 8Psi/N Adam (fp32).

:class:`DDPAdam` (stage 0, the baseline) all-reduces the same flat gradients and runs AdamW on
every element on every rank: memory (4 + 4 + 8) Psi.

Mixed precision (``param_dtype=torch.bfloat16`` or float16, the paper's setting): the model
computes with 16-bit parameters and gradients (2 + 2 bytes each), every rank keeps an fp32
*master* copy of its shard next to Adam's moments (4 + 4 + 4 = the paper's K = 12, all
sharded), updates the master, rounds it into its 16-bit shard and all-gathers 16-bit
values, so communication is 2 bytes per element too. With ``float32`` the parameters are
their own master copy (K = 8).

Parameters are grouped into *units* (default: the trainable parameters each module owns
directly), each unit one flat buffer padded to a multiple of N. Frozen parameters
(``requires_grad=False``) are not managed: they stay as they are on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from labkit.collectives.comm import Comm
from labkit.parallel.layout import global_rank
from labkit.zero.adam import AdamConfig, adamw_
from labkit.zero.partition import FlatLayout, flat_layout, flatten_into, param_views

__all__ = ["Unit", "make_units", "ZeRO1", "DDPAdam"]

class Ledger(Protocol):
    """Where ZeRO files its buffers: :class:`labkit.memory.MemoryTracker` fits."""

    def register(self, tensors: torch.Tensor, category: str) -> None: ...

    def category(self, name: str) -> AbstractContextManager[None]: ...


class _NoLedger:
    def register(self, tensors: torch.Tensor, category: str) -> None:
        return None

    def category(self, name: str) -> AbstractContextManager[None]:
        return nullcontext()


@dataclass(eq=False)
class Unit:
    """Parameters that share one flat buffer, and this rank's state for them."""

    owner: nn.Module  # ZeRO-3 gathers the unit around this module's forward and backward
    params: list[nn.Parameter]
    names: list[str]
    layout: FlatLayout
    shapes: list[torch.Size]  # recorded once: a sharded-away parameter has shape (0,)
    flat: torch.Tensor | None = None  # (padded,) full params; None while sharded away (ZeRO-3)
    shard: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # (shard_size,) my params
    master: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # fp32 (= shard in fp32)
    grad: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # full (stage 0/1) or shard
    exp_avg: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    exp_avg_sq: torch.Tensor = field(default_factory=lambda: torch.empty(0))


def make_units(model: nn.Module, wrap: Sequence[nn.Module] | None = None) -> list[tuple[nn.Module, list[tuple[str, nn.Parameter]]]]:
    """Group the trainable parameters into ``(owner module, [(name, param)])`` units.

    ``wrap=None``: one unit per module that owns trainable parameters directly (finest
    grain: least memory in ZeRO-3, most collectives). ``wrap=[blocks...]``: one unit per
    listed module (all its parameters), the rest in one unit owned by ``model`` (FSDP's
    wrapping policy). A shared (tied) parameter goes to the first unit that meets it.
    """
    seen: set[int] = set()
    names = {id(p): n for n, p in model.named_parameters()}
    units: list[tuple[nn.Module, list[tuple[str, nn.Parameter]]]] = []

    def take(owner: nn.Module, params: Iterable[nn.Parameter]) -> None:
        unit = []
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                unit.append((names[id(p)], p))
        if unit:
            units.append((owner, unit))

    if wrap is None:
        for mod in model.modules():
            take(mod, mod.parameters(recurse=False))
    else:
        for mod in wrap:
            take(mod, mod.parameters())
        take(model, model.parameters())
    return units


class ZeRO1:
    """AdamW with the optimizer state sharded over ``group``. Call ``zero_grad``, backward
    (as many times as there are micro-batches), then ``step``."""

    shard_optimizer = True

    def __init__(self, model: nn.Module, cfg: AdamConfig | None = None, *, group: ProcessGroup | None = None, comm_impl: str = "torch", wrap: Sequence[nn.Module] | None = None, param_dtype: torch.dtype = torch.float32, memory: Ledger | None = None) -> None:
        if param_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"param_dtype must be float32, bfloat16 or float16, got {param_dtype}")
        self.param_dtype = param_dtype
        self.model = model
        self.cfg = cfg or AdamConfig()
        self.comm = Comm(group, comm_impl)
        self.group = group
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.memory: Ledger = memory or _NoLedger()  # a tracker: each buffer allocated in its category
        self.step_count = 0
        self.device = next(iter(model.parameters())).device
        self.units: list[Unit] = []
        for owner, named in make_units(model, wrap):
            names, params = [n for n, _ in named], [p for _, p in named]
            layout = flat_layout([p.numel() for p in params], self.world_size)
            self.units.append(Unit(owner, params, names, layout, [p.shape for p in params]))
        for u in self.units:
            self._build(u)
        model.to(param_dtype)  # frozen parameters and buffers (managed ones already are)

    # ----------------------------------------------------------------- construction
    def _zeros(self, n: int, category: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        with self.memory.category(category):
            return torch.zeros(n, dtype=dtype, device=self.device)

    def _full_params(self, u: Unit) -> torch.Tensor:
        """The unit's parameters as one fp32 (padded,) buffer, identical on every rank."""
        flat = self._zeros(u.layout.padded, "temporaries")
        flatten_into(flat, u.layout, [p.detach() for p in u.params])
        dist.broadcast(flat, src=global_rank(self.group, 0), group=self.group)
        return flat

    def _build(self, u: Unit) -> None:
        full32 = self._full_params(u)
        lo, hi = u.layout.shard_range(self.rank) if self.shard_optimizer else (0, u.layout.padded)
        if self.param_dtype == torch.float32:
            u.flat = full32
            self.memory.register(u.flat, "parameters")
        else:  # mixed precision: 16-bit compute copy + fp32 master of my shard (the paper's K=12)
            u.flat = self._zeros(u.layout.padded, "parameters", self.param_dtype).copy_(full32)
            with self.memory.category("optimizer_state"):
                u.master = full32[lo:hi].clone()
        del full32
        for p, view in zip(u.params, param_views(u.flat, u.layout, u.shapes)):
            p.data = view  # the module now computes with a view into the flat buffer
        u.shard = u.flat[lo:hi]  # my parameters: a view, so all-gather's output updates them
        if self.param_dtype == torch.float32:
            u.master = u.shard  # fp32 training: the parameters are their own master copy
        u.exp_avg, u.exp_avg_sq = self._zeros(hi - lo, "optimizer_state"), self._zeros(hi - lo, "optimizer_state")
        u.grad = self._zeros(u.layout.padded, "gradients", self.param_dtype)
        for p, view in zip(u.params, param_views(u.grad, u.layout, u.shapes)):
            p.grad = view  # autograd accumulates in place into the flat gradient buffer

    # ----------------------------------------------------------------- training
    def zero_grad(self) -> None:
        for u in self.units:
            u.grad.zero_()

    def _adopt_grads(self, u: Unit) -> None:
        """If someone replaced ``p.grad`` (``model.zero_grad()`` sets None), copy it back in."""
        for p, view in zip(u.params, param_views(u.grad, u.layout, u.shapes)):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view

    def _grad_shard(self, u: Unit) -> torch.Tensor:
        """Reduce-scatter the full gradients: my shard of their average over ranks."""
        self._adopt_grads(u)
        g = self._zeros(u.layout.shard_size, "temporaries", self.param_dtype)
        self.comm.reduce_scatter(g, u.grad)
        return g.float().div_(self.world_size)  # fp32 for the optimizer

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        for u in self.units:
            g = self._grad_shard(u)
            self._update(u, g)
            del g
            self._publish(u)

    def _update(self, u: Unit, grad32: torch.Tensor) -> None:
        """AdamW on my fp32 master shard; round it into my (16-bit) parameter shard."""
        adamw_(u.master, grad32, u.exp_avg, u.exp_avg_sq, self.step_count, self.cfg)
        if u.master is not u.shard:
            u.shard.copy_(u.master)

    def _publish(self, u: Unit) -> None:
        """All-gather the updated shards into every rank's full parameters."""
        assert u.flat is not None
        self.comm.all_gather(u.flat, u.shard.clone())  # clone: the input must not alias the output

    # ----------------------------------------------------------------- inspection
    def _gather_full(self, shard: torch.Tensor, u: Unit) -> torch.Tensor:
        if shard.numel() == u.layout.padded:
            return shard
        full = torch.empty(u.layout.padded, dtype=shard.dtype, device=shard.device)
        self.comm.all_gather(full, shard.contiguous())
        return full

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, dict[str, torch.Tensor]] | None:
        """Consolidate on rank 0 (collective: every rank must call it): ``{"params", "exp_avg",
        "exp_avg_sq"}`` each ``{name: full tensor}``, plus ``step``. Other ranks get None."""
        out: dict[str, dict[str, torch.Tensor]] = {"params": {}, "exp_avg": {}, "exp_avg_sq": {}}
        for u in self.units:
            for key, shard in (("params", u.master), ("exp_avg", u.exp_avg), ("exp_avg_sq", u.exp_avg_sq)):
                full = self._gather_full(shard, u)
                for name, view in zip(u.names, param_views(full, u.layout, u.shapes)):
                    out[key][name] = view.clone()
        out["step"] = {"step": torch.tensor(self.step_count)}
        return out if self.rank == 0 else None

    def managed(self) -> Sequence[nn.Parameter]:
        return [p for u in self.units for p in u.params]

    @property
    def num_params(self) -> int:
        """Psi: the trainable parameters managed (frozen ones excluded, padding excluded)."""
        return sum(u.layout.total for u in self.units)


class DDPAdam(ZeRO1):
    """Stage 0, the baseline: all-reduce the gradients, every rank runs AdamW on everything."""

    shard_optimizer = False

    def _grad_shard(self, u: Unit) -> torch.Tensor:
        self._adopt_grads(u)
        self.comm.all_reduce(u.grad)
        return u.grad.float().div_(self.world_size)

    def _publish(self, u: Unit) -> None:
        return None  # every rank updated every element already
