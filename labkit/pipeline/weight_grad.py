"""The zero-bubble split of a stage's backward: B (input gradient) now, W (weight gradient) later.

For ``y = a W^T + b`` the backward has two independent halves (Qi et al. 2023, section 2):
``dL/da = g W`` (the previous stage waits for it: B) and ``dL/dW = g^T a``, ``dL/db = sum g``
(nobody waits: W). Autograd computes both at once, or only what ``autograd.grad(inputs=...)``
asks for. So during F we record, for every Linear and LayerNorm of the stage, its input ``a``;
B runs ``autograd.grad(y, x)`` (input gradient only: autograd skips the weight products) and a
hook on each module's output keeps the gradient ``g`` flowing through it; W then computes::

    Linear:     W.grad += g^T a            (g, a flattened to (tokens, features))
                b.grad += sum_tokens g
    LayerNorm:  w.grad += sum_tokens g * (a - mean) / sqrt(var + eps)
                b.grad += sum_tokens g

which is exactly what autograd would have accumulated (up to summation order). Memory: W
keeps each module's input and output gradient until it runs, the price ZB-H1 pays in the
stash. Stages with other parametrized modules (e.g. the embedding) are not split here: the
executor runs their whole backward in B.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["WeightGradRecorder", "apply_weight_grads", "splittable"]

SPLIT = (nn.Linear, nn.LayerNorm)


def splittable(module: nn.Module) -> bool:
    """True when every trainable parameter of ``module`` sits in a Linear or LayerNorm."""
    for m in module.modules():
        own = [q for q in m.parameters(recurse=False) if q.requires_grad]
        if own and not isinstance(m, SPLIT):
            return False
    return True


class WeightGradRecorder:
    """Forward hooks on a stage's Linear/LayerNorm modules. Inside ``record()``, each call
    appends ``[module, input, output_grad]``; the output gradient arrives during B."""

    def __init__(self, module: nn.Module):
        self.entries: list[list[Any]] | None = None
        mods = [m for m in module.modules() if isinstance(m, SPLIT)]
        self.handles = [m.register_forward_hook(self._hook) for m in mods]

    def _hook(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        if self.entries is None or not output.requires_grad:
            return
        entry: list[Any] = [module, args[0].detach(), None]
        self.entries.append(entry)

        def keep(g: torch.Tensor) -> None:
            entry[2] = g

        output.register_hook(keep)

    @contextmanager
    def record(self):  # type: ignore[no-untyped-def]
        self.entries = []
        try:
            yield self.entries
        finally:
            self.entries = None

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _accumulate(param: torch.Tensor | None, value: torch.Tensor) -> None:
    """``param.grad += value`` as autograd's accumulation does it: in the parameter's dtype
    (under autocast ``value`` is 16-bit, the fp32 parameter's gradient is not), then the
    parameter's post-accumulate-grad hooks, which autograd would have run (ZeRO's "used"
    flags and DDP's bucket hooks hang there; without them a W-computed gradient is unseen)."""
    if param is None or not param.requires_grad:
        return
    value = value.to(param.dtype)
    if param.grad is None:
        param.grad = value
    else:
        param.grad += value
    for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
        hook(param)


def apply_weight_grads(entries: list[list[Any]]) -> None:
    """W: the weight gradients of the recorded modules from their inputs and output grads."""
    for module, a, g in entries:
        if g is None:  # the module's output did not reach the loss
            continue
        a2 = a.reshape(-1, a.shape[-1])  # (..., in) -> (tokens, in)
        g2 = g.reshape(-1, g.shape[-1])  # (..., out) -> (tokens, out)
        if isinstance(module, nn.Linear):
            _accumulate(module.weight, g2.t() @ a2)  # (out, tokens) @ (tokens, in)
        else:
            var, mean = torch.var_mean(a2, dim=-1, unbiased=False, keepdim=True)
            a_hat = (a2 - mean) * torch.rsqrt(var + module.eps)  # (tokens, d)
            _accumulate(module.weight, (g2 * a_hat).sum(0))
        _accumulate(module.bias, g2.sum(0))
