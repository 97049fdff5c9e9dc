"""FP8 against bf16 on a small GPT: loss curves, the tolerance they must meet, and a control.

Both runs are the same model, data and optimizer under bf16 autocast; the FP8 run swaps the
transformer blocks' linears (q, k, v, proj, fc, proj) for :class:`~labkit.precision.fp8.
Fp8Linear` (embedding and tied head stay high precision, as in DeepSeek-V3 and TE).

**The tolerance is derived, not chosen.** bf16 trained from ``seeds`` different seeds (init
and batch order) ends at slightly different losses; that seed-to-seed range is the noise
floor of "the same training". An FP8 recipe passes when its final loss (mean of the last
``window`` steps) is within that range of bf16's at the same seed: FP8 changes the run by
no more than a reseed does. The negative control (``unscaled``: FP8 casts with scale 1, so
gradients of a mean loss underflow e5m2) must miss by more than the range.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from labkit.data.shakespeare import CharDataset
from labkit.models import GPT, GPTConfig, lm_loss
from labkit.precision.fp8 import Fp8Config, fp8_linears

__all__ = ["CONTROL", "LESSON", "CurveSpec", "compare_curves", "lesson_runs", "train_curve"]


@dataclass(frozen=True)
class CurveSpec:
    """The run: a tiny character GPT on tiny-shakespeare, AdamW, ``steps`` steps."""

    steps: int = 300
    batch: int = 16
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    block: int = 64
    lr: float = 3e-3
    window: int = 50  # final loss = mean of the last ``window`` steps

    def __post_init__(self) -> None:
        if not 0 < self.window <= self.steps:
            raise ValueError(f"window={self.window} must be in 1..steps={self.steps}")


# The lesson's run: small enough for a notebook on a loaded 2-core CPU (a few hundred steps
# in all). At this size the gradients of the mean loss still sit inside e5m2's range
# unscaled, so the control drops both protections: no scaling and e4m3 (whose smallest
# subnormal is 2^-9) for the gradients.
LESSON = CurveSpec(steps=100, batch=8, block=32, n_embd=32, window=25)
CONTROL = Fp8Config(recipe="unscaled", grad_format="e4m3")


def lesson_runs() -> dict[str, Fp8Config]:
    """The four recipes and the control, by name, as the notebook and tests run them."""
    runs = {r: Fp8Config(recipe=r) for r in ("tensorwise", "delayed", "rowwise", "tiles")}
    return {**runs, "control": CONTROL}


_DATA: dict[int, CharDataset] = {}


def _data(block: int) -> CharDataset:
    if block not in _DATA:
        _DATA[block] = CharDataset(block_size=block)
    return _DATA[block]


def train_curve(spec: CurveSpec, fp8: Fp8Config | None, seed: int = 0) -> list[float]:
    """Per-step training losses; ``fp8=None`` is the bf16 baseline."""
    data = _data(spec.block)
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=data.vocab_size, block_size=spec.block, n_layer=spec.n_layer,
                    n_head=spec.n_head, n_embd=spec.n_embd)  # fmt: skip
    model = GPT(cfg)
    if fp8 is not None:
        fp8_linears(model, fp8, where=lambda n: n.startswith("blocks."))
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    g = torch.Generator().manual_seed(10_000 + seed)
    losses = []
    for _ in range(spec.steps):
        ix = torch.randint(len(data), (spec.batch,), generator=g).tolist()
        x = torch.stack([data[i][0] for i in ix])  # (B, T)
        y = torch.stack([data[i][1] for i in ix])  # (B, T)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _final(curve: list[float], window: int) -> float:
    tail = curve[-window:]
    return sum(tail) / len(tail)


def compare_curves(spec: CurveSpec, recipes: dict[str, Fp8Config],
                   seeds: tuple[int, ...] = (0, 1, 2), control: str = "control"
                   ) -> dict[str, Any]:  # fmt: skip
    """bf16 at every seed, each FP8 config at ``seeds[0]``; returns the curves, the derived
    tolerance (bf16's seed range of final losses), each run's gap to bf16 at ``seeds[0]``,
    and which pass. ``control`` names the entry of ``recipes`` that must fail."""
    if len(seeds) < 2:
        raise ValueError(f"need at least 2 seeds to derive a tolerance, got {seeds}")
    if control not in recipes:
        raise ValueError(f"control={control!r} is not one of {sorted(recipes)}")
    t0 = time.perf_counter()
    bf16 = {s: train_curve(spec, None, s) for s in seeds}
    finals = [_final(c, spec.window) for c in bf16.values()]
    tolerance = max(finals) - min(finals)
    ref = finals[0]
    curves = {name: train_curve(spec, cfg, seeds[0]) for name, cfg in recipes.items()}
    gaps = {name: _final(c, spec.window) - ref for name, c in curves.items()}
    return {
        "bf16": bf16, "fp8": curves, "tolerance": tolerance, "bf16_final": ref, "gaps": gaps,
        "passes": {name: abs(g) <= tolerance for name, g in gaps.items()},
        "control": control, "seconds": time.perf_counter() - t0,
    }  # fmt: skip
