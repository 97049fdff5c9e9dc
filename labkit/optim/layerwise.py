"""LARS and LAMB: layer-wise adaptive learning rates for large batches.

LARS (You, Gitman, Ginsburg 2017, "Large Batch Training of Convolutional Networks"), per
parameter tensor ``w`` with gradient ``g``, weight decay ``beta``, momentum ``m``::

    local = eta * ||w|| / (||g|| + beta * ||w||)        (1 when either norm is 0)
    v     = m * v + lr * local * (g + beta * w)
    w     = w - v

LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in
76 minutes"), Adam's bias-corrected moments, then the same trust ratio on the whole update::

    m_t = b1 m + (1 - b1) g,   v_t = b2 v + (1 - b2) g^2
    r   = m_t / (1 - b1^t) / (sqrt(v_t / (1 - b2^t)) + eps) + beta * w
    w   = w - lr * (||w|| / ||r||) * r                     (ratio 1 when either norm is 0)

One-dimensional tensors (biases, norm scales) keep a ratio of 1 (``exclude_1d``, as both
papers' reference code does): their norms say nothing about a layer's scale.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["LAMB", "LARS", "trust_ratio"]


def trust_ratio(weight_norm: torch.Tensor, update_norm: torch.Tensor) -> torch.Tensor:
    """``||w|| / ||u||``, or 1 when either is 0 (a fresh zero layer, a zero gradient)."""
    ok = (weight_norm > 0) & (update_norm > 0)
    return torch.where(ok, weight_norm / update_norm.clamp_min(1e-30), torch.ones_like(weight_norm))


def _accumulation_dtype(w: torch.Tensor) -> torch.dtype:
    """16-bit parameters update in fp32 (their norms and moments would lose bits); fp32 and
    fp64 ones in their own dtype."""
    return torch.promote_types(w.dtype, torch.float32)


def _check(lr: float, weight_decay: float, **more: float) -> None:
    bad = {k: v for k, v in {"lr": lr, "weight_decay": weight_decay, **more}.items() if v < 0}
    if bad or not lr > 0:
        raise ValueError(f"need lr > 0 and non-negative hyper-parameters, got lr={lr}, {bad}")


class LARS(torch.optim.Optimizer):
    """SGD with momentum whose step is scaled per tensor by ``eta * ||w|| / ||g + beta w||``."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        eta: float = 0.001,
        exclude_1d: bool = True,
    ) -> None:
        _check(lr, weight_decay, momentum=momentum, eta=eta)
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta,
                        exclude_1d=exclude_1d)  # fmt: skip
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        loss = None if closure is None else torch.enable_grad()(closure)()
        for group in self.param_groups:
            for w in group["params"]:
                if w.grad is None:
                    continue
                acc = _accumulation_dtype(w)
                g = w.grad.to(acc)
                local = torch.ones((), device=w.device, dtype=acc)
                if not (group["exclude_1d"] and w.ndim <= 1):
                    wn, gn = w.to(acc).norm(), g.norm()
                    local = group["eta"] * trust_ratio(wn, gn + group["weight_decay"] * wn)
                    g = g + group["weight_decay"] * w.to(acc)
                state = self.state[w]
                v = state.get("velocity")
                if v is None:
                    v = state["velocity"] = torch.zeros_like(g)
                v.mul_(group["momentum"]).add_(g * (group["lr"] * local))
                w.sub_(v.to(w.dtype))
        return loss


class LAMB(torch.optim.Optimizer):
    """Adam's direction, scaled per tensor so that the step is ``lr * ||w||`` long."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        exclude_1d: bool = True,
    ) -> None:
        _check(lr, weight_decay, eps=eps)
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        exclude_1d=exclude_1d)  # fmt: skip
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        loss = None if closure is None else torch.enable_grad()(closure)()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for w in group["params"]:
                if w.grad is None:
                    continue
                acc = _accumulation_dtype(w)
                g, wf = w.grad.to(acc), w.to(acc)
                state = self.state[w]
                if not state:
                    state.update(step=0, m=torch.zeros_like(g), v=torch.zeros_like(g))
                state["step"] += 1
                t, m, v = state["step"], state["m"], state["v"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                r = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + group["eps"])
                r = r + group["weight_decay"] * wf
                ratio = torch.ones((), device=w.device, dtype=acc)
                if not (group["exclude_1d"] and w.ndim <= 1):
                    ratio = trust_ratio(wf.norm(), r.norm())
                w.sub_((group["lr"] * ratio * r).to(w.dtype))
        return loss
