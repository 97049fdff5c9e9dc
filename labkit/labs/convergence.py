"""A short convergence check on the MNIST lab: batch B against k*B, curves compared (P2, K5).

Before a long run at a larger batch, train briefly at both and compare the loss *at equal
samples seen*. The large-batch run uses the linear scaling rule (Goyal et al. 2017,
``lr * k``) with a linear warm-up (:func:`labkit.labs.mnist_config.lr_at`); an adaptive
optimizer (LARS, LAMB: :mod:`labkit.optim`) is the fallback where that rule breaks.

One process trains on the effective batch: a data-parallel step averages the ranks' gradients
of equal shards, which is the gradient of the whole batch (notebook 01 proves it bit for bit),
so the curve is what ``k`` GPUs would produce, without their launch cost. The data is the
shipped MNIST split; the model is the lab's :class:`~labkit.models.MnistCNN`.

``spike`` is the largest training loss after the first step over the first step's loss:
above 1 the loss climbed above where it started (a loss spike); ``diverged`` means a
non-finite or exploding loss.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from labkit.data.mnist import MNIST
from labkit.labs.mnist_config import lr_at, scaled_lr
from labkit.models import MnistCNN
from labkit.optim import LAMB, LARS

__all__ = ["OPTIMIZERS", "TOLERANCE", "Curve", "compare", "train_curve"]

OPTIMIZERS = ("sgd", "lars", "lamb")
TOLERANCE = 0.1  # k*B passes when its final validation loss is within 10% of B's


@dataclass
class Curve:
    """One short run: validation loss against samples seen, and how it went."""

    batch: int
    lr: float
    optimizer: str
    warmup_steps: int
    clip: float | None
    samples: list[int] = field(default_factory=list)  # samples seen at each evaluation
    val_loss: list[float] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)  # per step
    seconds: float = 0.0

    @property
    def final(self) -> float:
        return self.val_loss[-1]

    @property
    def spike(self) -> float:
        """max training loss after step 0 / step 0's loss (> 1: the loss rose above its start)."""
        later = self.train_loss[1:] or self.train_loss
        return max(later) / self.train_loss[0]

    @property
    def diverged(self) -> bool:
        return not math.isfinite(self.final) or self.final > 2 * self.train_loss[0]

    @property
    def label(self) -> str:
        extra = f", clip {self.clip:g}" if self.clip else ""
        head = f"B={self.batch} {self.optimizer} lr {self.lr:.3g}"
        return f"{head}, warm-up {self.warmup_steps}{extra}"


def _optimizer(name: str, params: list[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)  # the lab's own optimizer
    if name == "lars":
        return LARS(params, lr=lr, momentum=0.9, eta=0.02)
    return LAMB(params, lr=lr)


def train_curve(
    batch: int,
    lr: float,
    *,
    samples: int = 4096,
    optimizer: str = "sgd",
    warmup_steps: int = 0,
    clip: float | None = None,
    evals: int = 5,
    channels: int = 8,
    val_size: int = 500,
    seed: int = 0,
    threads: int | None = 1,
) -> Curve:
    """Train the lab's CNN on ``samples`` images in steps of ``batch`` at ``lr`` and return the
    validation loss at ``evals`` evenly spaced points (the same points for every batch that
    divides them). The same ``seed`` gives every run the same initial weights and the same
    order of images, so two runs differ only in batch, lr and optimizer. ``threads``: torch's
    intra-op threads for the run (restored after): one keeps a small CNN from fighting for a
    shared machine's cores; ``None`` leaves the setting alone."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if batch < 1 or samples < batch or not lr > 0:
        raise ValueError(f"need 1 <= batch <= samples and lr > 0, got {batch}, {samples}, {lr}")
    train, val = MNIST("train"), MNIST("val")
    xv, yv = val.images[:val_size], val.labels[:val_size]
    torch.manual_seed(seed)
    model = MnistCNN(channels=channels)
    opt = _optimizer(optimizer, list(model.parameters()), lr)
    g = torch.Generator().manual_seed(seed)
    n = len(train.labels)
    order = torch.cat([torch.randperm(n, generator=g) for _ in range(-(-samples // n))])
    steps = samples // batch
    marks = {max(1, round(steps * (i + 1) / evals)) for i in range(evals)}
    curve = Curve(batch, lr, optimizer, warmup_steps, clip)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        _loop(curve, model, opt, train, order, steps, marks, xv, yv)
    finally:
        torch.set_num_threads(before)
    return curve


def _loop(curve: Curve, model: torch.nn.Module, opt: torch.optim.Optimizer, train: MNIST,
          order: torch.Tensor, steps: int, marks: set[int], xv: torch.Tensor,
          yv: torch.Tensor) -> None:  # fmt: skip
    batch, lr, warmup_steps, clip = curve.batch, curve.lr, curve.warmup_steps, curve.clip
    t0 = time.perf_counter()
    for step in range(steps):
        idx = order[step * batch : (step + 1) * batch]  # (batch,)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr, warmup_steps)
        loss = F.cross_entropy(model(train.images[idx]), train.labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        curve.train_loss.append(loss.item())
        if step + 1 in marks:
            with torch.no_grad():
                curve.val_loss.append(F.cross_entropy(model(xv), yv).item())
            curve.samples.append((step + 1) * batch)
        if not math.isfinite(curve.train_loss[-1]):
            curve.val_loss.append(math.nan)
            curve.samples.append((step + 1) * batch)
            break
    curve.seconds = time.perf_counter() - t0


def compare(
    base_batch: int,
    base_lr: float,
    k: int,
    *,
    samples: int = 4096,
    warmup_steps: int = 4,
    tolerance: float = TOLERANCE,
    small: Curve | None = None,
    **options: object,
) -> dict[str, object]:
    """The convergence check: batch B at ``base_lr`` against k*B at the linearly scaled lr
    with warm-up, over the same samples. ``passed`` when k*B's final validation loss is
    within ``tolerance`` (relative) of B's: then the long run at k*B is worth starting.
    ``small``: B's curve from an earlier call (same samples and options), not run again."""
    if small is None:
        small = train_curve(base_batch, base_lr, samples=samples, **options)  # type: ignore[arg-type]
    elif (small.batch, small.lr, small.samples[-1]) != (base_batch, base_lr, samples):
        raise ValueError(
            f"small is a run of B={small.batch} lr={small.lr} over {small.samples[-1]} samples, "
            f"not B={base_batch} lr={base_lr} over {samples}"
        )
    big_lr = scaled_lr(base_lr, base_batch, k * base_batch)
    big = train_curve(
        k * base_batch, big_lr, samples=samples, warmup_steps=warmup_steps, **options  # type: ignore[arg-type]
    )
    gap = big.final / small.final - 1
    return {"small": small, "big": big, "gap": gap, "passed": gap <= tolerance}
