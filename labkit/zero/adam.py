"""AdamW on flat fp32 tensors, written out so each rank can run it on its shard alone.

Adam is elementwise: the update of element i reads only ``param[i], grad[i], m[i], v[i]``.
That is the whole reason ZeRO-1 works: a rank holding a 1/N slice of the optimizer state
can update the matching 1/N slice of the parameters without seeing anything else.

The arithmetic matches ``torch.optim.AdamW`` (its single-tensor path) operation by operation:

    p <- p * (1 - lr * wd)
    m <- lerp(m, g, 1 - beta1)                 v <- beta2 * v + (1 - beta2) * g^2
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AdamConfig", "adamw_"]


@dataclass(frozen=True)
class AdamConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        b1, b2 = self.betas
        if not (
            self.lr >= 0
            and 0 <= b1 < 1
            and 0 <= b2 < 1
            and self.eps >= 0
            and self.weight_decay >= 0
        ):
            raise ValueError(f"invalid AdamW hyper-parameters: {self}")


@torch.no_grad()
def adamw_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    cfg: AdamConfig,
) -> None:
    """One AdamW step in place on 1-D fp32 tensors of equal length (``step`` counts from 1)."""
    b1, b2 = cfg.betas
    param.mul_(1 - cfg.lr * cfg.weight_decay)
    exp_avg.lerp_(grad, 1 - b1)
    exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    step_size = cfg.lr / (1 - b1**step)
    denom = (exp_avg_sq.sqrt() / (1 - b2**step) ** 0.5).add_(cfg.eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
