"""Each FP8 recipe's error per GEMM against fp32, and where each overflows or underflows.

:func:`capture_gemms` trains a tiny character GPT in fp32 for a few steps and records one
linear's x (M, K), W (N, K) and upstream gradient dy (M, N) at every step: real activations
and gradients, not random ones. :func:`gemm_error_table` runs the last step's three GEMMs
(forward x W^T, dgrad dy W, wgrad dy^T x) through every recipe, the delayed one with its
history filled by the earlier steps, and reports

    rel_err = mean over rows i of ||fp8_i - fp32_i|| / ||fp32_i||

per GEMM with the fraction of each recipe's operand elements that overflowed (saturated at
the format's max) or underflowed (non-zero, cast to zero). An ``outliers`` case multiplies a
few tokens' activations by ``outlier`` ("massive activations", Sun et al. 2024, reach
thousands of times the median): a per-tensor scale then spends the range on them and pushes
every other token toward the underflow.

:func:`range_table` sweeps the magnitude of a GEMM's input over powers of two and reports,
per recipe, the band where the forward error stays near its best: unbounded for dynamic
scales, the format's own window for the unscaled control, and for the delayed recipe whose
history saw magnitude 1, a ceiling at ``2^margin`` (saturation) and a floor where the stale
large scale sends values into the subnormals.
"""

from __future__ import annotations

import copy

import torch

from labkit.models import GPT, GPTConfig, lm_loss
from labkit.precision.fp8 import E4M3, RECIPES, Fp8Config, Recipe, make_recipe
from labkit.precision.fp8.linear import fp8_linear
from labkit.precision.fp8.scaled import Scaled, expand

__all__ = ["capture_gemms", "gemm_error_table", "range_table"]

Step = dict[str, torch.Tensor]  # "x" (M, K), "w" (N, K), "dy" (M, N)


def capture_gemms(steps: int = 4, layer: str = "blocks.0.mlp.fc", seed: int = 0,
                  batch: int = 8, block: int = 64, n_embd: int = 128) -> list[Step]:  # fmt: skip
    """``layer``'s x, W and dy at each of ``steps`` fp32 AdamW steps of a tiny GPT trained on
    random tokens (the magnitudes, not the text, matter here)."""
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=65, block_size=block, n_layer=2, n_head=4, n_embd=n_embd)
    model = GPT(cfg)
    lin = model.get_submodule(layer)
    if not isinstance(lin, torch.nn.Linear):
        raise ValueError(f"{layer!r} is a {type(lin).__name__}, not an nn.Linear")
    rec: Step = {}

    def keep_x(_m: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        rec["x"] = args[0].detach().reshape(-1, args[0].shape[-1]).clone()  # (B,T,K)->(M,K)
        out.register_hook(lambda g: rec.__setitem__("dy", g.reshape(-1, g.shape[-1]).clone()))

    lin.register_forward_hook(keep_x)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for _ in range(steps):
        idx = torch.randint(0, 65, (batch, block + 1))
        rec["w"] = lin.weight.detach().clone()
        lm_loss(model(idx[:, :-1]), idx[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        out.append(dict(rec))
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of ||a_i - b_i|| / ||b_i||: per token (per feature for wgrad), so one
    huge row cannot hide the error of all the others."""
    return float(((a - b).norm(dim=1) / b.norm(dim=1).clamp_min(1e-30)).mean())


def _lost(t: torch.Tensor, q: Scaled) -> tuple[float, float]:
    """(overflowed, underflowed) fractions of ``t``'s non-zero elements under ``q``."""
    fmax = torch.finfo(q.data.dtype).max
    nz = t != 0
    n = max(int(nz.sum()), 1)
    # past the max by more than the division's rounding (amax / (amax / max) ~ max)
    over = t.abs() / expand(q.scale, q.block, q.data.shape) > fmax * (1 + 1e-6)
    under = nz & (q.data.float() == 0)
    return float(over.sum()) / n, float(under.sum()) / n


def _run(cfg: Fp8Config, steps: list[Step]) -> dict[str, float]:
    recipe = make_recipe(cfg)
    for s in steps[:-1]:  # history for the delayed recipe (no-ops for the others)
        _gemms(s, recipe, cfg)
    return _gemms(steps[-1], recipe, cfg)


def _gemms(s: Step, recipe: Recipe, cfg: Fp8Config) -> dict[str, float]:
    x, w, dy = (s[k].clone().requires_grad_(k != "dy") for k in ("x", "w", "dy"))
    ref_y, (ref_dx, ref_dw) = x @ w.t(), (dy @ w, dy.t() @ x)
    # the forward input as the linear is about to cast it (a copy: the history stays put)
    qx = copy.deepcopy(recipe).quantize(s["x"], E4M3, 1, "activation", "input")
    y = fp8_linear(x, w, None, recipe, cfg)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    over, under = _lost(s["x"], qx)
    return {"fwd": _rel(y.detach(), ref_y.detach()), "dgrad": _rel(dx, ref_dx.detach()),
            "wgrad": _rel(dw, ref_dw.detach()), "x_over": over, "x_under": under}  # fmt: skip


def gemm_error_table(steps: list[Step] | None = None, outlier: float = 1e4,
                     kernel: str = "emulated") -> list[dict[str, object]]:  # fmt: skip
    """One row per (case, recipe): the three GEMMs' relative errors against fp32 and the
    forward input's overflow/underflow fractions."""
    steps = steps or capture_gemms()
    cases = {"gpt": steps, "outliers": [_with_outliers(s, outlier) for s in steps]}
    rows: list[dict[str, object]] = []
    for case, st in cases.items():
        for name in RECIPES:
            r = _run(Fp8Config(recipe=name, kernel=kernel), st)
            rows.append({"case": case, "recipe": name, **r})
    return rows


def _with_outliers(s: Step, factor: float, tokens: int = 2) -> Step:
    x = s["x"].clone()
    x[:tokens] *= factor  # a few tokens carry huge activations (Sun et al. 2024)
    return {**s, "x": x}


def range_table(powers: range = range(-40, 41, 4), margin: int = 0, n: int = 64,
                slack: float = 2.0) -> list[dict[str, object]]:  # fmt: skip
    """Per recipe: the lowest and highest power of two k (input x 2^k) where the forward
    GEMM's error is within ``slack`` x its best, the first k that overflows (saturates), and
    the error at every k. The delayed recipe's history was filled at k = 0."""
    g = torch.Generator().manual_seed(0)
    x0, w = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g) / n**0.5
    rows: list[dict[str, object]] = []
    for name in RECIPES:
        cfg = Fp8Config(recipe=name, margin=margin)
        errs: dict[int, float] = {}
        over: list[int] = []
        for k in powers:
            recipe = make_recipe(cfg)
            recipe.quantize(x0, E4M3, 1, "activation", "input")  # history at k = 0 (delayed)
            x = x0 * 2.0**k
            q = recipe.quantize(x, E4M3, 1, "activation", "input")
            errs[k] = _rel(q.dequantize() @ w.t(), x @ w.t())
            if _lost(x, q)[0] > 0:
                over.append(k)
        best = min(errs.values())
        good = [k for k, e in errs.items() if e <= slack * best]
        rows.append({"recipe": name, "low": min(good), "high": max(good),
                     "overflows_from": min(over) if over else None, "errors": errs})  # fmt: skip
    return rows
