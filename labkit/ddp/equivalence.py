"""The proof harness: a model with every awkward parameter, and the two training loops to compare.

The spec every DDP variant must meet: trained ``steps`` optimizer steps on ``world_size``
ranks, each rank seeing ``1 / world_size`` of every micro-batch, the parameters after
*every* step equal those of single-process training on the full micro-batches (up to
float summation order), and are bit-identical across ranks.

:class:`AwkwardNet` packs the cases that break naive implementations:

* ``frozen.weight`` has ``requires_grad=False`` (must never change, must still be broadcast);
* ``tied.weight`` is one Parameter applied twice (its two gradients are summed by autograd;
  it must be reduced once);
* ``extra`` runs only on the samples flagged by ``mask``: in some steps no rank uses it
  (its ``grad`` must stay None: SGD's momentum and weight decay would move it otherwise),
  in others only rank 0 does (the other ranks must still join the collective).

Ranks build their model from *different* seeds, so only the broadcast from rank 0 makes them
agree. The optimizer is SGD with momentum and weight decay for the reason above.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

Snapshot = dict[str, torch.Tensor]


class AwkwardNet(nn.Module):
    def __init__(self, d_in: int = 8, d: int = 16, classes: int = 4):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.frozen = nn.Linear(d, d)
        self.frozen.weight.requires_grad_(False)
        self.tied = nn.Linear(d, d, bias=False)
        self.extra = nn.Linear(d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.frozen(torch.relu(self.inp(x))))  # (B, d)
        h = self.tied(torch.relu(self.tied(h)))  # the same weight, used twice
        idx = mask.nonzero().flatten()  # (n_flagged,)
        if idx.numel() > 0:  # data-dependent: no graph through `extra` when nobody is flagged
            h = h.index_add(0, idx, self.extra(h[idx]))
        return self.head(h)  # (B, classes)


def make_batches(
    steps: int, accum: int, batch: int, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``steps * accum`` micro-batches ``(x, y, mask)`` of ``batch`` samples (the global batch).

    The mask follows a cycle of three optimizer steps (all micro-batches of a step alike):
    nobody flagged (no rank uses ``extra``: its grad must stay None); only sample 0 flagged
    (only rank 0's shard uses it); random flags.
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps * accum):
        x = torch.randn(batch, 8, generator=g)
        y = torch.randint(0, 4, (batch,), generator=g)
        mask = torch.zeros(batch, dtype=torch.bool)
        kind = (i // accum) % 3
        if kind == 1:
            mask[0] = True
        elif kind == 2:
            mask = torch.rand(batch, generator=g) < 0.3
        out.append((x, y, mask))
    return out


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def _snapshot(model: nn.Module) -> Snapshot:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_reference(
    steps: int = 4, accum: int = 1, batch: int = 12, seed: int = 0
) -> list[Snapshot]:
    """Single-process training on the full micro-batches; parameters after each step."""
    torch.manual_seed(seed)
    model = AwkwardNet()
    opt = _optimizer(model)
    batches = make_batches(steps, accum, batch, seed)
    snaps = []
    for s in range(steps):
        for x, y, mask in batches[s * accum : (s + 1) * accum]:
            (F.cross_entropy(model(x, mask), y) / accum).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        snaps.append(_snapshot(model))
    return snaps


def train_distributed(
    wrap: Callable[[nn.Module], nn.Module],
    steps: int = 4,
    accum: int = 1,
    batch: int = 12,
    seed: int = 0,
    group: Any = None,
) -> tuple[list[Snapshot], list[int]]:
    """Run on every rank: ``wrap(model)`` trained on this rank's shard of each micro-batch.

    ``wrap`` builds the data-parallel wrapper (ours, or torch DDP). Returns the parameters
    after each step and, for labkit's wrappers, the number of gradient elements reduced per
    step (tied weights counted once). Micro-batches ``0 .. accum-2`` of a step run inside
    ``no_sync()``.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if batch % world:
        raise ValueError(f"batch={batch} must be divisible by world_size={world}")
    torch.manual_seed(seed + 1000 * rank)  # different on purpose: the broadcast must fix it
    model = wrap(AwkwardNet())
    inner: nn.Module = getattr(model, "module", model)
    opt = _optimizer(inner)
    batches = make_batches(steps, accum, batch, seed)
    snaps, reduced = [], []
    for s in range(steps):
        for m, (x, y, mask) in enumerate(batches[s * accum : (s + 1) * accum]):
            shard = slice(rank * batch // world, (rank + 1) * batch // world)  # contiguous shard
            last = m == accum - 1
            ctx = contextlib.nullcontext() if last else model.no_sync()  # type: ignore[operator]
            with ctx:
                out = model(x[shard], mask[shard])
                (F.cross_entropy(out, y[shard]) / accum).backward()
        finish = getattr(model, "finish_gradient_sync", None)
        if finish is not None:
            finish()
            reduced.append(int(model.elements_reduced))  # type: ignore[arg-type]
        opt.step()
        opt.zero_grad(set_to_none=True)
        snaps.append(_snapshot(inner))
    return snaps, reduced


def first_divergence(
    expected: list[Snapshot], got: list[Snapshot], atol: float = 1e-5, rtol: float = 1e-4
) -> str | None:
    """None if every parameter matches after every step, else a sentence naming the first miss."""
    if len(got) != len(expected):
        return f"expected {len(expected)} steps of parameters, got {len(got)}"
    for step, (exp, out) in enumerate(zip(expected, got)):
        for name, e in exp.items():
            g = out.get(name)
            if g is None:
                return f"step {step}: parameter {name!r} is missing"
            if not torch.allclose(g, e, atol=atol, rtol=rtol):
                i = int((g - e).abs().flatten().argmax())
                return (
                    f"after step {step + 1}, parameter {name!r} diverges first: element {i} is "
                    f"{g.flatten()[i].item():.6g}, single-process training gives "
                    f"{e.flatten()[i].item():.6g}"
                )
    return None


def trainable_numel() -> int:
    """Gradient elements one sync must reduce: every trainable parameter, tied ones once."""
    return sum(p.numel() for p in AwkwardNet().parameters() if p.requires_grad)


def train_many(
    wraps: dict[str, Callable[[nn.Module], nn.Module]],
    steps: int = 4,
    accum: int = 1,
    group: Any = None,
) -> dict[str, list[Snapshot]]:
    """Run on every rank: :func:`train_distributed` for each wrapper.

    Returns each wrapper's parameters per step, by name."""
    return {
        name: train_distributed(wrap, steps, accum, group=group)[0] for name, wrap in wraps.items()
    }
