"""The timeline of a data-parallel step: what ran when, and the handle of an all-reduce in flight.

Split from ``base.py`` (the wrapper, which re-exports both): an :class:`Event` is one interval
(a backward, or an all-reduce of one buffer) in seconds since the step's ``forward``; a
:class:`Pending` is an all-reduce that was started and not yet waited on. Its event's end is
NaN until the collective's completion callback, or the first :meth:`Pending.wait`, fills it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Event", "Pending"]


@dataclass
class Event:
    """One interval on the timeline, in seconds since the wrapper's ``forward`` of this step."""

    kind: str  # "backward" or "allreduce"
    name: str
    start: float
    end: float


class Pending:
    """A started all-reduce; :meth:`wait` blocks until the buffer holds the sum."""

    def __init__(self, wait: Callable[[], Any], event: Event, now: Callable[[], float]):
        self._wait, self.event, self._now = wait, event, now

    def wait(self) -> None:
        self._wait()
        if self.event.end != self.event.end:  # NaN: the completion callback has not run yet
            self.event.end = self._now()
