"""What every exercise check shares: run the learner's code on ranks, compare, explain in words.

A check never just says "wrong". It names where the first difference is (rank, element,
parameter, step) and shows expected against got, because that is what a learner debugs from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from labkit.launch import RankFailedError, launch

__all__ = ["CheckFailed", "compare", "launch_check", "passed"]

_GREEN, _RESET = "\033[32m", "\033[0m"


class CheckFailed(AssertionError):
    """The learner's code ran but produced a wrong result; the message says where and how."""


def compare(
    expected: torch.Tensor,
    got: torch.Tensor,
    *,
    what: str,
    atol: float = 1e-6,
    rtol: float = 1e-5,
) -> str | None:
    """None when ``got`` matches ``expected``; otherwise one sentence naming the first difference.

    Shapes and dtypes are checked first (a wrong shape is the most common ring bug: a chunk
    computed with the wrong length), then values with
    ``|got - expected| <= atol + rtol*|expected|``.
    """
    if not isinstance(got, torch.Tensor):
        return f"{what}: expected a tensor, got {type(got).__name__}"
    if got.shape != expected.shape:
        return f"{what}: expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
    if got.dtype != expected.dtype:
        return f"{what}: expected dtype {expected.dtype}, got {got.dtype}"
    if expected.numel() == 0:
        return None
    e, g = expected.detach().double().cpu(), got.detach().double().cpu()
    bad = ~((g - e).abs() <= atol + rtol * e.abs())
    bad |= torch.isnan(g) != torch.isnan(e)
    if not bool(bad.any()):
        return None
    flat = int(bad.flatten().nonzero()[0])
    index = (
        tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), e.shape)) if e.dim() else ()
    )
    n_bad = int(bad.sum())
    return (
        f"{what}: {n_bad} of {e.numel()} elements differ; first at index {index}: "
        f"expected {e.flatten()[flat].item():.6g}, got {g.flatten()[flat].item():.6g}"
    )


def launch_check(
    fn: Callable[..., Any], *args: Any, world_size: int, timeout: float = 120.0, **options: Any
) -> list[Any]:
    """``launch`` for checks: a rank's ``NotImplementedError`` is re-raised as one, here.

    An exercise stub raises ``NotImplementedError``; the learner should see exactly that,
    not a wall of launcher output. Any other rank failure propagates unchanged.
    """
    try:
        return launch(fn, *args, world_size=world_size, timeout=timeout, **options)
    except RankFailedError as exc:
        if exc.exc_type == "NotImplementedError":
            why = exc.exc_message or "this part of the exercise is not written yet"
            raise NotImplementedError(f"rank {exc.rank}: {why}") from None
        raise


def passed(message: str) -> None:
    print(f"{_GREEN}PASSED{_RESET}: {message}")
