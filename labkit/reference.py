"""The one reference harness: toy models, the single-process loop, the first-divergence report.

Every proof in labkit has the same shape: train a small model in ONE process on the full
batch (:func:`train_reference`), train the parallel version on ranks, and compare the two
after every optimizer step (:func:`first_divergence`). Tests assert the report is ``None``;
exercise checks show it to the learner, because "wrong" alone is not debuggable: it names
the step, the parameter, the element and both values.

Closeness is torch's own (:func:`torch.testing.assert_close`):
``|got - expected| <= atol + rtol * |expected|`` element-wise, after shape and dtype agree.

The reference loop is gradient accumulation, written once: per optimizer step, each of the
step's ``k`` micro-batches contributes ``loss / k`` to the gradients, then one
``optimizer.step()``. A data-parallel run over N ranks, each seeing ``1/N`` of every
micro-batch, must land on the same parameters up to float summation order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "AwkwardNet",
    "Snapshot",
    "Trace",
    "first_difference",
    "first_divergence",
    "first_mismatch",
    "grad_snapshot",
    "snapshot",
    "train_reference",
]

Snapshot = dict[str, torch.Tensor]


# ----------------------------------------------------------------------------- toy models
class AwkwardNet(nn.Module):
    """Every parameter that breaks a naive data-parallel implementation, in one small net.

    * ``frozen.weight`` has ``requires_grad=False`` (must never change, must still be
      broadcast);
    * ``tied.weight`` is one Parameter applied twice (autograd sums its two gradients; it
      must be reduced once);
    * ``extra`` runs only on the samples flagged by ``mask``: in some steps no rank uses it
      (its ``grad`` must stay None), in others only one rank does (the others must still join
      the collective).
    """

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


# ----------------------------------------------------------------------------- the loop
def snapshot(named: Iterable[tuple[str, nn.Parameter]]) -> Snapshot:
    """Detached copies of parameters, by name."""
    return {name: p.detach().clone() for name, p in named}


def grad_snapshot(named: Iterable[tuple[str, nn.Parameter]]) -> dict[str, torch.Tensor | None]:
    """Detached copies of the parameters' ``.grad``, by name; None where there is none."""
    return {name: None if p.grad is None else p.grad.detach().clone() for name, p in named}


@dataclass
class Trace:
    """What a reference run leaves: parameters after every step, the mean loss of every step
    (sum over micro-batches of ``loss / k``) and the first step's accumulated gradients."""

    params: list[Snapshot] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    first_grads: dict[str, torch.Tensor | None] = field(default_factory=dict)


def train_reference(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: Iterable[Sequence[Sequence[Any]]],
    loss_fn: Callable[..., torch.Tensor],
) -> Trace:
    """Single-process gradient accumulation: ``steps`` yields each step's micro-batches.

    A micro-batch is a tuple of arguments; its loss is ``loss_fn(model, *micro_batch)``.
    """
    trace = Trace()
    for i, micro_batches in enumerate(steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for mb in micro_batches:
            loss = loss_fn(model, *mb) / len(micro_batches)
            loss.backward()
            total += loss.item()
        if i == 0:
            trace.first_grads = grad_snapshot(model.named_parameters())
        opt.step()
        trace.losses.append(total)
        trace.params.append(snapshot(model.named_parameters()))
    return trace


# ----------------------------------------------------------------------------- the report
def first_mismatch(
    expected: torch.Tensor, got: torch.Tensor, atol: float = 1e-6, rtol: float = 1e-5
) -> tuple[int, int] | None:
    """None if ``got`` is close to ``expected``; else (first flat index that is not, count).

    The verdict is :func:`torch.testing.assert_close`'s (in float64 on the CPU, so a bf16
    run is judged by the tolerance, not by its own rounding); the index is located with the
    same rule, :func:`torch.isclose`.
    """
    if expected.shape != got.shape:
        return 0, expected.numel()
    e, g = expected.detach().double().cpu(), got.detach().double().cpu()
    try:
        torch.testing.assert_close(g, e, atol=atol, rtol=rtol)
        return None
    except AssertionError:
        bad = ~torch.isclose(g, e, atol=atol, rtol=rtol)
        return int(bad.flatten().nonzero()[0]), int(bad.sum())


def first_difference(
    expected: torch.Tensor,
    got: Any,
    *,
    what: str,
    atol: float = 1e-6,
    rtol: float = 1e-5,
) -> str | None:
    """None when ``got`` matches ``expected``; otherwise one sentence naming the first difference.

    Type, shape and dtype are checked first (a wrong shape is the most common ring bug: a
    chunk computed with the wrong length), then values (:func:`first_mismatch`).
    """
    if not isinstance(got, torch.Tensor):
        return f"{what}: expected a tensor, got {type(got).__name__}"
    if got.shape != expected.shape:
        return f"{what}: expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
    if got.dtype != expected.dtype:
        return f"{what}: expected dtype {expected.dtype}, got {got.dtype}"
    miss = first_mismatch(expected, got, atol, rtol)
    if miss is None:
        return None
    flat, n_bad = miss
    index = (
        tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), expected.shape))
        if expected.dim()
        else ()
    )
    return (
        f"{what}: {n_bad} of {expected.numel()} elements differ; first at index {index}: "
        f"expected {expected.flatten()[flat].item():.6g}, got {got.flatten()[flat].item():.6g}"
    )


def first_divergence(
    expected: list[Snapshot],
    got: list[Snapshot],
    atol: float = 1e-5,
    rtol: float = 1e-4,
    reference: str = "the single-process reference",
) -> str | None:
    """None if every parameter matches after every step, else a sentence naming the first miss:
    ``after step S, parameter 'name' diverges first: element i is G, <reference> gives E``."""
    if len(got) != len(expected):
        return f"expected {len(expected)} steps of parameters, got {len(got)}"
    for step, (exp, out) in enumerate(zip(expected, got)):
        for name, e in exp.items():
            g = out.get(name)
            if g is None:
                return f"after step {step + 1}, parameter {name!r} is missing"
            if g.shape != e.shape:
                return (
                    f"after step {step + 1}, parameter {name!r} has shape {tuple(g.shape)}, "
                    f"{reference} has {tuple(e.shape)}"
                )
            miss = first_mismatch(e, g, atol, rtol)
            if miss is not None:
                i = miss[0]
                return (
                    f"after step {step + 1}, parameter {name!r} diverges first: element {i} is "
                    f"{g.flatten()[i].item():.6g}, {reference} gives {e.flatten()[i].item():.6g}"
                )
    return None
