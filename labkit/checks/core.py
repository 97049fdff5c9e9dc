"""What every exercise check shares: run the learner's code on ranks, compare, explain in words.

A check never just says "wrong". It names where the first difference is (rank, element,
parameter, step) and shows expected against got, because that is what a learner debugs from.
The report itself (``compare``) is :func:`labkit.reference.first_difference`, the one that
tests use too.

A check run on an unfilled stub is not a failure of the learner's code: the stub still has its
placeholder (``# YOUR CODE HERE`` then ``raise NotImplementedError("exercise: ...")``, written by
``tools/make_exercises.py``). :func:`exercise_not_done` names that placeholder (the function,
its line, the rank) in a ``NotImplementedError`` that shows as one short message in Jupyter
instead of a traceback through the check's internals; :func:`not_done` finds the placeholder
in any exception that reached the notebook, which :func:`install_notebook_hook` uses for
checks that run the stub in-process. The type stays ``NotImplementedError``, what the stub
raised.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any

from labkit.checks.stub_scan import STUB_PREFIX, find_stub
from labkit.launch import RankFailedError, launch
from labkit.reference import first_difference as compare  # the one first-difference report

__all__ = [
    "CheckFailed",
    "compare",
    "exercise_not_done",
    "install_notebook_hook",
    "launch_check",
    "not_done",
    "passed",
]

_GREEN, _YELLOW, _RESET = "\033[32m", "\033[33m", "\033[0m"
_FRAME = re.compile(r'File "(?P<file>[^"]*)", line (?P<line>\d+), in (?P<name>\S+)')


class CheckFailed(AssertionError):
    """The learner's code ran but produced a wrong result; the message says where and how."""


def exercise_not_done(where: str) -> NotImplementedError:
    """A ``NotImplementedError`` that names the placeholder ``where`` (function, line, rank).

    In Jupyter it renders as its message alone (IPython's ``_render_traceback_`` protocol,
    set on the instance so the type stays the stub's own): the check's machinery says
    nothing to a learner who has not started. ``.placeholder`` keeps ``where``."""
    message = (
        f"{STUB_PREFIX} not written yet: {where} still has its `# YOUR CODE HERE` placeholder. "
        "Replace the `raise NotImplementedError(...)` line under it with your code, run that "
        "cell, then run this check again."
    )
    exc = NotImplementedError(message)
    exc.placeholder = where  # type: ignore[attr-defined]
    exc._render_traceback_ = lambda: [f"{_YELLOW}EXERCISE NOT DONE{_RESET}: {message}"]  # type: ignore[attr-defined]
    return exc


def _where(name: str, line: int | str, rank: int | None = None) -> str:
    on = f" on rank {rank}" if rank is not None else ""
    return f"`{name}` (line {line} of its cell){on}"


def not_done(exc: BaseException) -> NotImplementedError | None:
    """The :func:`exercise_not_done` error an exception stands for, or None if not a stub's.

    A stub's ``NotImplementedError("exercise: ...")`` raised in this process names the
    innermost frame (the stub); one re-raised from a rank (:func:`launch_check`) is passed as
    is. Anything else is the learner's real error and keeps its traceback."""
    if not isinstance(exc, NotImplementedError) or not str(exc).startswith(STUB_PREFIX):
        return None
    if hasattr(exc, "placeholder"):
        return exc
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return exercise_not_done("an exercise function")
    last = frames[-1]
    return exercise_not_done(_where(last.name, last.lineno or "?"))


def install_notebook_hook() -> bool:
    """In IPython, show a stub's ``NotImplementedError`` as :func:`exercise_not_done`'s short
    message, however deep in a check it was raised; every other exception keeps its full
    traceback. Returns whether a shell was there to hook. Idempotent."""
    try:
        from IPython import get_ipython
    except ImportError:  # plain Python: tracebacks stay as they are
        return False
    shell = get_ipython()
    if shell is None:
        return False

    def handler(
        self: Any, etype: type, value: BaseException, tb: TracebackType, tb_offset: Any = None
    ) -> None:
        # IPython discards what a custom handler returns for errors raised while running a
        # cell: the handler shows the error itself (and so keeps the kernel's error message)
        short = not_done(value)
        if short is None:
            self.showtraceback((etype, value, tb), tb_offset=tb_offset)
        else:
            self._showtraceback(etype, value, short._render_traceback_())  # type: ignore[attr-defined]

    shell.set_custom_exc((NotImplementedError,), handler)
    return True


def launch_check(
    fn: Callable[..., Any], *args: Any, world_size: int, timeout: float = 120.0, **options: Any
) -> list[Any]:
    """``launch`` for checks: a rank's ``NotImplementedError`` is re-raised as one, here.

    An exercise stub raises ``NotImplementedError``; the learner should see exactly that,
    not a wall of launcher output. A stub that ``fn`` or an argument still holds (a function,
    a class's methods: :func:`labkit.checks.stub_scan.find_stub`) is named before any process
    starts (no launch to wait for); one the scan cannot see (in a global the learner's code
    calls) is named from the rank's traceback. Any other rank failure propagates unchanged.
    """
    stub = find_stub(fn, *args, *options.values())
    if stub is not None:
        raise exercise_not_done(_where(*stub))
    try:
        return launch(fn, *args, world_size=world_size, timeout=timeout, **options)
    except RankFailedError as exc:
        if exc.exc_type == "NotImplementedError":
            if exc.exc_message.startswith(STUB_PREFIX):  # the stub's placeholder: name it
                frames = _FRAME.findall(exc.rank_traceback)
                _, line, name = frames[-1] if frames else ("", "?", "an exercise function")
                raise exercise_not_done(_where(name, line, exc.rank)) from None
            why = exc.exc_message or "this part of the exercise is not written yet"
            raise NotImplementedError(f"rank {exc.rank}: {why}") from None
        raise


install_notebook_hook()  # importing a check in a notebook is what makes stubs read short


def passed(message: str) -> None:
    print(f"{_GREEN}PASSED{_RESET}: {message}")
