"""Check for exercise 04 (dynamic loss scaling): replay GradScaler's decisions against yours.

We train a tiny model with ``torch.amp.GradScaler``, injecting inf/nan into a gradient at
chosen steps, and record after every step whether it overflowed, the scale and the growth
tracker. Then we feed the same overflow/no-overflow sequence to the learner's
``update_scale`` and report the first step where the two disagree. The rule is a pure
function, so the check runs in this process (no ranks needed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from labkit.checks.core import CheckFailed, passed

__all__ = ["CASES", "ScalerCase", "check_update_rule", "record_gradscaler_trace"]

UpdateRule = Callable[..., tuple[float, int]]


@dataclass(frozen=True)
class ScalerCase:
    name: str
    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    overflow_steps: tuple[int, ...]
    steps: int = 24


CASES = (
    ScalerCase("PyTorch's factors, short interval", 2.0**16, 2.0, 0.5, 3, (0, 1, 5, 7, 8, 15)),
    ScalerCase("overflow in the middle of a streak", 2.0**10, 2.0, 0.5, 4, (2, 5, 11, 12, 19)),
    ScalerCase("factors that are not powers of two", 100.0, 1.5, 0.3, 2, (1, 2, 3, 7, 10)),
    ScalerCase("growth would overflow fp32", 2.0**126, 4.0, 0.5, 1, (6,)),
)


def record_gradscaler_trace(case: ScalerCase) -> list[tuple[bool, float, int]]:
    """``(found_inf, scale, growth_tracker)`` after each step of a real GradScaler run."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=case.init_scale, growth_factor=case.growth_factor,
        backoff_factor=case.backoff_factor, growth_interval=case.growth_interval,
    )  # fmt: skip
    trace = []
    for step in range(case.steps):
        opt.zero_grad()
        scaler.scale(model(torch.randn(3, 4)).pow(2).mean()).backward()
        overflow = step in case.overflow_steps
        if overflow and model.weight.grad is not None:
            model.weight.grad[0, 0] = float("nan") if step % 2 else float("inf")
        scaler.step(opt)
        scaler.update()
        state = scaler.state_dict()
        trace.append((overflow, state["scale"], state["_growth_tracker"]))
    return trace


def check_update_rule(update_scale: UpdateRule) -> None:
    """``update_scale(scale, growth_tracker, found_inf, *, growth_factor, backoff_factor,
    growth_interval) -> (scale, growth_tracker)`` must follow GradScaler step for step."""
    for case in CASES:
        trace = record_gradscaler_trace(case)
        scale, tracker = float(torch.tensor(case.init_scale, dtype=torch.float32)), 0
        history: list[str] = []
        for step, (found_inf, want_scale, want_tracker) in enumerate(trace):
            got = update_scale(
                scale, tracker, found_inf, growth_factor=case.growth_factor,
                backoff_factor=case.backoff_factor, growth_interval=case.growth_interval,
            )  # fmt: skip
            if not (isinstance(got, tuple) and len(got) == 2):
                raise CheckFailed(
                    f"update_scale must return a tuple (scale, growth_tracker), got {got!r}"
                )
            got_scale, got_tracker = float(got[0]), int(got[1])
            line = (
                f"  step {step:2d}: {'OVERFLOW' if found_inf else 'ok      '}  "
                f"GradScaler scale={want_scale:<12.6g} tracker={want_tracker}   "
                f"yours scale={got_scale:<12.6g} tracker={got_tracker}"
            )
            history.append(line)
            if got_scale != want_scale or got_tracker != want_tracker:
                what = "scale" if got_scale != want_scale else "growth tracker"
                raise CheckFailed(
                    f"case '{case.name}' (init_scale={case.init_scale:g}, "
                    f"growth_factor={case.growth_factor}, "
                    f"backoff_factor={case.backoff_factor}, "
                    f"growth_interval={case.growth_interval}): "
                    f"your {what} first differs from GradScaler's at step {step}, "
                    f"which {'overflowed' if found_inf else 'had finite gradients'}.\n"
                    f"Input to that step: scale={scale:g}, growth_tracker={tracker}.\n"
                    + "\n".join(history[-6:])
                )
            scale, tracker = got_scale, got_tracker
    steps = sum(c.steps for c in CASES)
    passed(
        f"your update rule follows torch.amp.GradScaler on {len(CASES)} runs "
        f"({steps} steps, with injected overflows)"
    )
