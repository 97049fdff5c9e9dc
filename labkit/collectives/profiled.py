"""One profiler range per labkit collective, so a profile counts labkit's all-reduces too.

torch's collectives appear in ``torch.profiler`` as ``gloo:all_reduce`` (``nccl:...``), one
range per call. labkit's travel as point-to-point messages (``gloo:send``/``recv``), which no
profiler would call an all-reduce, so ``labkit.profiling.breakdown`` would count none.
:func:`profiled` gives each public collective a range ``labkit:<collective>``, which
``breakdown.COUNTED`` matches. Single colon: ``labkit::`` names the regions of a step.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch.autograd.profiler as autograd_profiler
from torch.profiler import record_function

__all__ = ["PROFILE_PREFIX", "profiled"]

PROFILE_PREFIX = "labkit:"  # "labkit:all_reduce" (profiling.breakdown.COUNTED matches it)
_P = ParamSpec("_P")
_R = TypeVar("_R")
_inside = threading.local()  # .on: this thread is inside a labkit collective


def profiled(collective: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Run the decorated collective inside a ``record_function`` range named
    ``labkit:<collective>`` (e.g. ``labkit:all_reduce``), so a profile counts it as torch's
    ``gloo:all_reduce`` is counted; labkit's own travel as point-to-point messages, which no
    profiler would call an all-reduce.

    Only the outermost labkit collective of a thread opens a range: the ring's reduce-scatter
    inside its all-reduce, or the algorithm ``auto.all_reduce`` picked, is part of one call,
    not a second one. Per thread, because DDP's communication thread runs its own.
    """
    name = PROFILE_PREFIX + collective

    def wrap(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(fn)
        def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            # no profiler running (the usual case): no range; opening one costs ~10 us, a
            # tenth of a small all-reduce. torch.profiler.profile sets this flag for every
            # thread while it records. Nested: counted by the outer one.
            if not autograd_profiler._is_profiler_enabled or getattr(_inside, "on", False):
                return fn(*args, **kwargs)
            _inside.on = True
            try:
                with record_function(name):
                    return fn(*args, **kwargs)
            finally:
                _inside.on = False

        return run

    return wrap
