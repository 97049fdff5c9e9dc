"""Check for exercise 18 (delayed scaling): replay an amax sequence against Transformer
Engine's rule, and name the wrong approach when it is the usual one.

The learner writes ``delayed_scale_update(amax, history, fmt_max, margin) -> (scale,
new_history)``: the dequantisation scale for *this* step's tensor from the history of the
*previous* steps' amaxes (``max(history) * 2^margin / fmt_max``, 1 while the history is
all zero), and the history with this step's amax put first and the oldest dropped. The
reference is :func:`labkit.precision.fp8.delayed.delayed_scaling_step`. The rule is a pure
function, so the check runs in this process.

The common wrong answer scales with this step's own amax: that is the tensorwise dynamic
recipe (nothing ever saturates, and the amax must be known before the cast, the very pass
delayed scaling exists to avoid). The check recognises it and says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from labkit.checks.core import CheckFailed, passed
from labkit.precision.fp8.delayed import delayed_scaling_step
from labkit.precision.fp8.scaled import E4M3

__all__ = ["AMAXES", "check_delayed_scaling", "scale_trace"]

Update = Callable[[torch.Tensor, torch.Tensor, float, int], Any]
FMAX = torch.finfo(E4M3).max
# zeros first (an untouched layer), slow growth, a spike, a long decay, a second spike
AMAXES = (0.0, 0.0, 1.0, 1.2, 1.5, 1.4, 24.0, 2.0, 1.0, 0.5, 0.25, 0.2, 0.1, 0.1, 3.0, 2.5)


def _pair(got: Any) -> tuple[float, list[float]]:
    if not (isinstance(got, tuple) and len(got) == 2):
        raise CheckFailed(f"delayed_scale_update must return (scale, new_history), got {got!r}")
    scale, hist = got
    scale = torch.as_tensor(scale, dtype=torch.float32)
    if scale.numel() != 1:
        raise CheckFailed(f"the scale is one number per tensor, got shape {tuple(scale.shape)}")
    return float(scale), torch.as_tensor(hist, dtype=torch.float32).flatten().tolist()


def scale_trace(update: Update, history_len: int = 4, margin: int = 0
                ) -> list[tuple[float, float]]:  # fmt: skip
    """``(amax, scale * fmt_max)`` per step of :data:`AMAXES` under ``update``: the largest
    magnitude each step's scale can represent (above it, the cast saturates)."""
    hist, out = torch.zeros(history_len), []
    for a in AMAXES:
        scale, h = _pair(update(torch.tensor(a), hist.clone(), FMAX, margin))
        out.append((a, scale * FMAX))
        hist = torch.tensor(h)
    return out


def check_delayed_scaling(update: Update) -> None:
    """Raise :class:`CheckFailed` at the first step where ``update`` departs from TE's rule."""
    for history_len, margin in ((4, 0), (3, 1), (1, 2)):
        hist = torch.zeros(history_len)
        for step, a in enumerate(AMAXES):
            amax = torch.tensor(a)
            want_scale, want_hist = delayed_scaling_step(amax, hist.clone(), E4M3, margin)
            got_scale, got_hist = _pair(update(amax, hist.clone(), FMAX, margin))
            before = [round(x, 3) for x in hist.tolist()]
            where = (f"history_len={history_len}, margin={margin}, step {step}: history "
                     f"before {before}, this step's amax {a}")  # fmt: skip
            if not torch.isclose(torch.tensor(got_scale), want_scale.reshape(()), rtol=1e-6):
                own = a * 2.0**margin / FMAX if a > 0 else 1.0
                if abs(got_scale - own) <= 1e-6 * own and abs(own - float(want_scale)) > 1e-9:
                    raise CheckFailed(
                        f"{where}: your scale {got_scale:.6g} comes from this step's amax. "
                        f"That is tensorwise dynamic scaling; delayed scaling casts this "
                        f"step's tensor with the scale of the PREVIOUS steps' amaxes "
                        f"(max of the history before you add this one): "
                        f"{float(want_scale):.6g}")  # fmt: skip
                raise CheckFailed(
                    f"{where}: scale {got_scale:.6g}, expected {float(want_scale):.6g} = "
                    f"max(history) * 2^margin / fmt_max (1.0 while the history is all zero)"
                )
            if len(got_hist) != history_len or any(
                abs(x - y) > 1e-6 * max(1.0, abs(y)) for x, y in zip(got_hist, want_hist.tolist())
            ):
                raise CheckFailed(
                    f"{where}: new history {[round(x, 3) for x in got_hist]}, expected "
                    f"{[round(x, 3) for x in want_hist.tolist()]} (newest first, same length, "
                    f"the oldest dropped)")  # fmt: skip
            hist = want_hist
    saturated = sum(a > s for a, s in scale_trace(update))
    passed(f"your update follows Transformer Engine's delayed scaling over {len(AMAXES)} steps "
           f"and 3 (history, margin) settings; with history 4 and no margin, {saturated} of "
           f"the steps saturate (their amax outgrew the history)")  # fmt: skip
