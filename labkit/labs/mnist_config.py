"""Lab 01's settings, and the arithmetic of its batch and learning rate.

Split from ``mnist.py`` (the training loop and its launchers, which re-exports all of this),
so the rules read on their own and other modules (the quiz, the profiling lab) use them
without the loop.

What one optimizer step sees (the *effective batch*)::

    effective_batch = batch_size (per rank) * world_size * accum

so 2 ranks x 32 x accumulation 2 take the same step as 1 rank x 128. The linear scaling
rule (Goyal et al., "Accurate, Large Minibatch SGD", 2017) keeps the learning rate
proportional to the effective batch; its warmup ramps the rate up linearly over the first
steps, because at step 0 the weights are random and a large rate diverges.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.ddp.compression import make_compression

__all__ = ["SYNCS", "MnistConfig", "effective_batch", "lr_at", "scaled_lr"]

SYNCS = ("torch_ddp", "labkit", "none")


@dataclass
class MnistConfig:
    epochs: float = 3.0  # fractions allowed: 0.5 = half of each rank's shard
    batch_size: int = 32  # per rank, per micro-batch
    accum: int = 1  # micro-batches per optimizer step
    lr: float = 0.05  # SGD with momentum 0.9
    warmup_steps: int = 0  # linear ramp from lr/warmup_steps to lr
    max_steps: int | None = None  # stop early (short measured runs)
    train_limit: int | None = None  # use the first N training images (None: all 8,000)
    channels: int = 8  # MnistCNN width: 8 keeps an epoch at a few seconds on one core
    sync: str = "torch_ddp"  # "torch_ddp" | "labkit" (OverlappedDDP) | "none" (no averaging)
    compression: str = "none"  # with sync="labkit": "fp16", "bf16", "powersgd<r>[-noef]"
    check_sync: bool = False  # after every step, compare each rank's parameters to rank 0's
    seed: int = 0
    data_root: str | None = None  # folder with the full 60k MNIST; None: the shipped 10k split
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("batch_size", "accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.epochs > 0:
            raise ValueError(f"epochs must be > 0, got {self.epochs}")
        if not self.lr > 0 or self.warmup_steps < 0:
            raise ValueError(
                "need lr > 0 and warmup_steps >= 0, "
                f"got lr={self.lr}, warmup_steps={self.warmup_steps}"
            )
        if self.sync not in SYNCS:
            raise ValueError(f"sync must be one of {SYNCS}, got {self.sync!r}")
        make_compression(self.compression)  # a bad name fails here, before any process starts
        if self.compression != "none" and self.sync != "labkit":
            raise ValueError(
                f"compression={self.compression!r} needs sync='labkit' (labkit's OverlappedDDP), "
                f"got sync={self.sync!r}"
            )


def effective_batch(batch_size: int, world_size: int, accum: int) -> int:
    """Samples behind one optimizer step."""
    return batch_size * world_size * accum


def scaled_lr(base_lr: float, base_batch: int, batch: int) -> float:
    """The linear scaling rule: k times the batch, k times the learning rate."""
    return base_lr * batch / base_batch


def lr_at(step: int, lr: float, warmup_steps: int) -> float:
    """Linear warmup: ``lr * (step + 1) / warmup_steps`` for the first steps, then ``lr``."""
    if warmup_steps == 0 or step >= warmup_steps:
        return lr
    return lr * ((step + 1) / warmup_steps)  # reaches exactly lr at step warmup_steps - 1
