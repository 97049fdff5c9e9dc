"""What every exercise check shares: run the learner's code on ranks, compare, explain in words.

A check never just says "wrong". It names where the first difference is (rank, element,
parameter, step) and shows expected against got, because that is what a learner debugs from.
The report itself (``compare``) is :func:`labkit.reference.first_difference`, the one that
tests use too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from labkit.launch import RankFailedError, launch
from labkit.reference import first_difference as compare  # the one first-difference report

__all__ = ["CheckFailed", "compare", "launch_check", "passed"]

_GREEN, _RESET = "\033[32m", "\033[0m"


class CheckFailed(AssertionError):
    """The learner's code ran but produced a wrong result; the message says where and how."""


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
