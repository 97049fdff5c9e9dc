"""Gradient underflow in 16 bits, measured: why fp16 needs a loss scaler and bf16 does not (K4).

fp16 has 5 exponent bits: below 2^-24 (about 6e-8) a number is 0. bf16 keeps fp32's 8
exponent bits (its smallest normal is about 1e-38) and gives up mantissa bits instead. Late
in training the gradient of a mean loss over many elements is tiny: here a linear layer
``y = x W`` under the loss ``mean(y * r)`` over its ``N = n d`` outputs, with ``r`` a fixed
residual-like tensor of size about 1e-3 (a nearly fitted model), so ``dL/dy = r / N``, about
4e-9 at the default sizes (N = 262,144): below fp16's smallest subnormal, well inside bf16's range.

Each precision computes the same backward in its own dtype (weights, inputs, activations and
gradients all 16-bit: what autocast's matmuls do), optionally with the loss multiplied by a
scale ``S`` and the gradient divided by ``S`` again in fp32 (the loss scaler's unscale).
Reported per precision: the share of weight-gradient elements that came out exactly 0 and the
relative error of the gradient against fp32's.
"""

from __future__ import annotations

import torch

__all__ = ["gradient_underflow"]


def _grad(x: torch.Tensor, w0: torch.Tensor, r: torch.Tensor, dtype: torch.dtype,
          scale: float) -> torch.Tensor:  # fmt: skip
    w = w0.detach().to(dtype).clone().requires_grad_()  # a fresh leaf in this dtype
    y = x.to(dtype) @ w  # (n, d)
    # backward: S / N in fp32, cast to 16 bits, times r: the scale lifts r / N into range
    loss = (y * r.to(dtype)).float().mean() * scale  # the loss in fp32, as under autocast
    loss.backward()
    assert w.grad is not None
    return w.grad.float() / scale  # unscale in fp32, as the scaler does


def gradient_underflow(
    n: int = 4096, d: int = 64, residual: float = 1e-3, scale: float = 2.0**16, seed: int = 0
) -> dict[str, dict[str, float]]:
    """``{"fp32", "fp16", "fp16 + scaler", "bf16": {"zero": share, "error": relative}}``."""
    if min(n, d) < 1 or not residual > 0 or not scale >= 1:
        raise ValueError(f"need n, d >= 1, residual > 0, scale >= 1; got {n}, {d}, "
                         f"{residual}, {scale}")  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w0 = torch.randn(d, d, generator=g) / d**0.5
    r = residual * torch.randn(n, d, generator=g)  # (n, d), fp16-representable (> 6e-5)
    ref = _grad(x, w0, r, torch.float32, 1.0)
    runs = {
        "fp32": ref,
        "fp16": _grad(x, w0, r, torch.float16, 1.0),
        "fp16 + scaler": _grad(x, w0, r, torch.float16, scale),
        "bf16": _grad(x, w0, r, torch.bfloat16, 1.0),
    }
    return {
        name: {
            "zero": float((grad == 0).float().mean()),
            "error": float((grad - ref).norm() / ref.norm()),
        }
        for name, grad in runs.items()
    }
