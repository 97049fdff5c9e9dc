"""The one way tests run work on N ranks when they do not test process life itself.

Equivalence, collectives and memory tests call :func:`run_ranks`; tests of launching, killing,
hangs and interrupts call ``labkit.launch`` directly. Keeping every other multi-rank test on
this one function lets the suite share warm processes (a persistent world per world size)
without touching the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from labkit import launch


def run_ranks(fn: Callable[..., Any], *args: Any, world_size: int, timeout: float = 120, **kwargs: Any) -> list[Any]:
    """``fn(*args)`` on ``world_size`` gloo ranks (CPU tensors), bounded by ``timeout`` seconds;
    returns the per-rank results, indexed by rank."""
    kwargs.setdefault("quiet", True)
    kwargs.setdefault("backend", "gloo")
    return launch(fn, *args, world_size=world_size, timeout=timeout, **kwargs)
