"""Dynamic loss scaling, from scratch, with exactly the semantics of ``torch.amp.GradScaler``.

Why scale the loss at all? fp16 has 5 exponent bits: its smallest normal number is 2^-14
(about 6e-5) and its subnormals stop at 2^-24 (about 6e-8). Gradients of a deep network are
often smaller than that, so computed in fp16 they silently become 0. Multiplying the loss
by ``S`` multiplies every gradient by ``S`` (backward is linear in the upstream gradient),
lifting them into fp16's range; dividing by ``S`` again *in fp32* before the optimizer step
("unscale") gives back the true gradient. bf16 has fp32's 8 exponent bits, so it rarely
needs scaling; it loses mantissa bits, not range.

Why *dynamic*? Too large an ``S`` makes gradients overflow to inf. The scaler searches for
the largest safe ``S`` on the fly (Micikevicius et al., "Mixed Precision Training", 2018):

* start at ``init_scale`` (2^16);
* a step whose gradients hold an inf or nan is **skipped** (no optimizer step) and the scale
  is multiplied by ``backoff_factor`` (0.5); the streak of good steps restarts at 0;
* after ``growth_interval`` (2000) consecutive good steps, multiply by ``growth_factor``
  (2.0) -- unless that would overflow fp32, in which case the scale stays -- and restart
  the streak.

The scale is kept as an fp32 number, rounded like PyTorch's ``_amp_update_scale_`` kernel
does, and ``1/S`` is computed in fp64 then rounded to fp32, so the unscaled gradients are
bit-identical to GradScaler's (tests/test_precision.py replays a run with injected
overflows against it).

Distributed: when gradients are sharded (ZeRO-2/3, FSDP) each rank sees only part of them,
so one rank can find an inf the others do not. If ranks disagreed, some would step and some
would not, and the replicas would silently diverge. So ``found_inf`` is all-reduced with
MAX over ``group`` before anyone decides (what ``ShardedGradScaler`` does). Under plain DDP
the gradients are already identical and the all-reduce is one cheap scalar.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

__all__ = ["DynamicLossScaler", "update_scale", "to_fp32"]


def to_fp32(x: float) -> float:
    """Round a Python float (fp64) to the nearest fp32 value; overflow gives ``inf``."""
    return float(torch.tensor(x, dtype=torch.float64).to(torch.float32))


def update_scale(
    scale: float,
    growth_tracker: int,
    found_inf: bool,
    *,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
) -> tuple[float, int]:
    """The dynamic loss scaler's update rule: ``(scale, growth_tracker)`` after one step.

    ``growth_tracker`` counts consecutive steps without inf/nan. A pure function, so it can
    be tested alone (and it is the exercise in ``solutions/04_loss_scaler.ipynb``).
    """
    if found_inf:
        return to_fp32(scale * backoff_factor), 0
    successful = growth_tracker + 1
    if successful == growth_interval:
        grown = to_fp32(scale * growth_factor)
        return (grown if math.isfinite(grown) else scale), 0
    return scale, successful


class DynamicLossScaler:
    """``scale(loss).backward()`` -> ``step(optimizer)`` -> ``update()``, like GradScaler.

    ``step`` unscales the gradients (unless ``unscale_`` was already called, e.g. to clip
    them), checks them for inf/nan, agrees on that across ``group`` and runs
    ``optimizer.step()`` only when every rank's gradients are finite. It returns whether
    the step was taken. ``update`` then applies :func:`update_scale`.

    ``group``: the ranks that must agree on skipping (None = WORLD). The agreement only
    happens inside an initialised process group; ``sync_found_inf=False`` turns it off for a
    scaler that is private to one rank.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        *,
        group: dist.ProcessGroup | None = None,
        sync_found_inf: bool = True,
    ) -> None:
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"init_scale must be a positive finite number, got {init_scale!r}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1.0, got {growth_factor!r}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if (
            isinstance(growth_interval, bool)
            or not isinstance(growth_interval, int)
            or growth_interval < 1
        ):
            raise ValueError(f"growth_interval must be a positive int, got {growth_interval!r}")
        self._scale = to_fp32(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self._growth_tracker = 0
        self.group = group
        self.sync_found_inf = sync_found_inf
        # id(optimizer) -> found_inf of its unscaled gradients (this iteration only)
        self._found_inf: dict[int, bool] = {}
        self._stepped: set[int] = set()
        self.last_step_skipped = False

    # ------------------------------------------------------------------ the four calls
    def get_scale(self) -> float:
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S``. Call ``.backward()`` on the result."""
        return loss * torch.tensor(self._scale, dtype=torch.float32, device=loss.device)

    def unscale_(self, optimizer: Optimizer) -> bool:
        """Divide ``optimizer``'s gradients by ``S`` in place; return found_inf (agreed).

        Call it explicitly only to inspect or clip true gradients before ``step``.
        """
        key = id(optimizer)
        if key in self._found_inf:
            raise RuntimeError(
                "unscale_() was already called on this optimizer since the last update()"
            )
        if key in self._stepped:
            raise RuntimeError("unscale_() is being called after step()")
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        for grad in grads:
            if grad.dtype == torch.float16:
                # An fp16 gradient divided by S may underflow again: copy it to fp32 master
                # gradients first (labkit.precision.mixed does), as GradScaler also insists.
                raise ValueError(
                    "refusing to unscale fp16 gradients: unscale fp32 (master) gradients"
                )
        found = self._unscale_grads(grads)
        self._found_inf[key] = found
        return found

    def step(self, optimizer: Optimizer) -> bool:
        """Unscale if needed, then ``optimizer.step()`` unless any rank found inf/nan."""
        key = id(optimizer)
        if key in self._stepped:
            raise RuntimeError("step() has already been called since the last update()")
        found = self._found_inf[key] if key in self._found_inf else self.unscale_(optimizer)
        self._stepped.add(key)
        if not found:
            optimizer.step()
        return not found

    def update(self) -> None:
        """Back off after an overflow, grow after ``growth_interval`` good steps."""
        if not self._found_inf:
            raise RuntimeError("update() needs a step() (or unscale_()) on some optimizer first")
        found = any(self._found_inf.values())
        self.last_step_skipped = found
        self._scale, self._growth_tracker = update_scale(
            self._scale,
            self._growth_tracker,
            found,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
        )
        self._found_inf.clear()
        self._stepped.clear()

    # ------------------------------------------------------------------ internals
    def _unscale_grads(self, grads: list[torch.Tensor]) -> bool:
        if not grads:
            return False
        device = grads[0].device
        # 1/S in fp64, rounded to fp32: what GradScaler multiplies by, so results match bitwise.
        inv_scale = torch.tensor(1.0 / self._scale, dtype=torch.float32, device=device)
        with torch.no_grad():
            if all(g.device == device for g in grads):
                # Two multi-tensor kernels for all gradients (what a GPU needs: one small kernel
                # per tensor costs more in launches than the arithmetic): the inf-norm of each
                # gradient is inf or nan exactly when the gradient holds one.
                norms = torch.stack(torch._foreach_norm(grads, float("inf")))  # (num_grads,)
                found = (~torch.isfinite(norms)).any().to(torch.float32)
                torch._foreach_mul_(grads, inv_scale)
            else:  # gradients on several devices: one tensor at a time
                found = torch.zeros((), dtype=torch.float32, device=device)
                for grad in grads:
                    found = torch.maximum(
                        found, (~torch.isfinite(grad)).any().to(found.dtype).to(device)
                    )
                    grad.mul_(inv_scale.to(grad.device))
        if self.sync_found_inf and dist.is_available() and dist.is_initialized():
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)
        return bool(found.item())

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Same keys as ``GradScaler.state_dict()``: either can load the other's."""
        return {
            "scale": self._scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self._growth_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {
            "scale",
            "growth_factor",
            "backoff_factor",
            "growth_interval",
            "_growth_tracker",
        } - set(state)
        if missing:
            raise KeyError(f"loss scaler state is missing {sorted(missing)}")
        self._scale = to_fp32(float(state["scale"]))
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self._growth_tracker = int(state["_growth_tracker"])
