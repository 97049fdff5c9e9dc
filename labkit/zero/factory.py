"""Build a ZeRO stage by name: ``make_optimizer("zero2", model, AdamConfig(lr=1e-3))``.

=========  ======================================  ===============================
stage      class                                   sharded over the ranks
=========  ======================================  ===============================
``ddp``    :class:`~labkit.zero.stage0.DDPAdam`    nothing (the baseline)
``zero1``  :class:`~labkit.zero.stage1.ZeRO1`      optimizer state
``zero2``  :class:`~labkit.zero.stage2.ZeRO2`      + gradients
``zero3``  :class:`~labkit.zero.stage3.ZeRO3`      + parameters
=========  ======================================  ===============================
"""

from __future__ import annotations

from typing import Any

from torch import nn

from labkit.zero.adam import AdamConfig
from labkit.zero.sharded import ShardedAdamW
from labkit.zero.stage0 import DDPAdam
from labkit.zero.stage1 import ZeRO1
from labkit.zero.stage2 import ZeRO2
from labkit.zero.stage3 import ZeRO3

__all__ = ["STAGE_CLASSES", "make_optimizer"]

STAGE_CLASSES: dict[str, type[ShardedAdamW]] = {
    "ddp": DDPAdam,
    "zero1": ZeRO1,
    "zero2": ZeRO2,
    "zero3": ZeRO3,
}


def make_optimizer(
    stage: str, model: nn.Module, cfg: AdamConfig | None = None, **kwargs: Any
) -> ShardedAdamW:
    """``STAGE_CLASSES[stage](model, cfg, **kwargs)`` with a clear error for a bad name;
    ``prefetch`` is dropped for the stages that keep full parameters (it has no meaning)."""
    if stage not in STAGE_CLASSES:
        raise ValueError(f"unknown stage {stage!r}; expected one of {sorted(STAGE_CLASSES)}")
    if stage != "zero3":
        kwargs.pop("prefetch", None)
    return STAGE_CLASSES[stage](model, cfg, **kwargs)
