"""Delayed scaling (Transformer Engine): the scale comes from an amax *history*, not from now.

Computing ``amax(t)`` before casting ``t`` costs a pass over the tensor and a sync point in
the middle of the GEMM's inputs. Transformer Engine (``DelayedScaling``: ``amax_history_len``,
``amax_compute_algo="max"``, ``margin``) instead scales this step's tensor with what the
previous steps saw and records this step's amax for the next ones:

    scale_t   = max(history_{t-1}) / fmt_max * 2^margin     (1 while the history is all zero)
    data_t    = saturate(t / scale_t)                          (clamped at fmt_max: no inf)
    history_t = [amax(t), history_{t-1}[:-1]]                  (newest first, fixed length)

The amax of the current tensor is therefore computed *alongside* the cast (fused into the
kernel on a GPU) and only used afterwards. The bet is that magnitudes drift slowly: a tensor
whose amax jumps above ``max(history) * 2^margin`` saturates this step (counted in
``saturated``); ``margin`` buys headroom for such jumps at the cost of ``margin`` powers of
two of the underflow side. A longer history reacts later to a *shrinking* amax (the old peak
keeps the scale large, pushing small values into the subnormals).

Taking the scale from ``amax(t)`` instead is the tensorwise dynamic recipe, not this one:
:func:`delayed_scaling_step` must never read ``t`` before it has its scale.
"""

from __future__ import annotations

import torch

from labkit.precision.fp8.recipe import Recipe
from labkit.precision.fp8.scaled import scale_from_amax

__all__ = ["Delayed", "delayed_scaling_step"]


def delayed_scaling_step(
    amax: torch.Tensor, history: torch.Tensor, dtype: torch.dtype, margin: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the recipe: ``(scale for this step's tensor, the new history)``.

    ``amax``: this step's amax (a 0-d or 1-element tensor), ``history``: (L,) fp32, newest
    first. The scale depends on ``history`` alone; ``amax`` only enters the new history.
    """
    scale = scale_from_amax(history.max(), dtype, margin)  # the past only
    new_history = torch.roll(history, 1)  # (L,): the oldest falls off the end
    new_history[0] = amax.reshape(())
    return scale.reshape(1, 1), new_history


class Delayed(Recipe):
    """Per-tensor blocks (as tensorwise); each ``role`` ("input", "weight", "grad_output")
    of one layer keeps its own history of ``history_len`` amaxes. Requantisations in the
    backward (``role=None``) never happen: a tensor-wide block fits every contraction."""

    name = "delayed"

    def __init__(self, history_len: int = 16, margin: int = 0) -> None:
        if history_len < 1:
            raise ValueError(f"history_len={history_len} must be >= 1")
        self.history_len, self.margin = history_len, margin
        self.history: dict[str, torch.Tensor] = {}
        self.saturated: dict[str, int] = {}  # steps whose amax exceeded the scale's range

    def fresh(self) -> Delayed:
        return Delayed(self.history_len, self.margin)

    def scale(self, amax: torch.Tensor, dtype: torch.dtype, role: str | None) -> torch.Tensor:
        if role is None:
            raise ValueError("delayed scaling needs a role to keep a history for")
        hist = self.history.get(role, torch.zeros(self.history_len))
        scale, self.history[role] = delayed_scaling_step(amax, hist, dtype, self.margin)
        over = bool(amax.max() > scale.max() * torch.finfo(dtype).max)
        self.saturated[role] = self.saturated.get(role, 0) + int(over)
        return scale
