"""Find an unfilled exercise stub in the learner's code before a check starts any process.

Every generated stub is the line ``raise NotImplementedError("exercise: ...")`` (written by
``tools/make_exercises.py``). Its message is a string constant of the function's code object,
and ``NotImplementedError`` one of the names it loads, so the compiled code alone shows the
stub: no source is needed (a function typed in a kernel, exec'd or pickled still has its code
object). The constant's bytecode offset maps, through ``co_lines``, to the line the learner
sees in its cell, the same line a traceback from the rank would name.

What is scanned: functions (and the functions nested in them), methods, static and class
methods and properties of a class and its bases, bound methods and ``functools.partial``. What
is not: the globals a function calls (a stub there still raises on the rank, and
:func:`labkit.checks.core.launch_check` names it from the rank's traceback).
"""

from __future__ import annotations

import dis
import functools
import types
from collections.abc import Iterator
from typing import Any

STUB_PREFIX = "exercise:"  # how every generated stub's NotImplementedError message starts

__all__ = ["STUB_PREFIX", "find_stub"]


def find_stub(*objects: Any) -> tuple[str, int | str] | None:
    """``(qualified name, line)`` of the first stub in ``objects`` (in order), else None."""
    seen: set[int] = set()
    for obj in objects:
        for code in _codes(obj, seen):
            hit = _stub_in(code)
            if hit is not None:
                return hit
    return None


def _codes(obj: Any, seen: set[int]) -> Iterator[types.CodeType]:
    """The code objects ``obj`` runs directly (each object visited once)."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, types.CodeType):
        yield obj
    elif isinstance(obj, types.FunctionType):
        yield obj.__code__
    elif isinstance(obj, (types.MethodType, staticmethod, classmethod)):
        yield from _codes(obj.__func__, seen)
    elif isinstance(obj, property):
        for part in (obj.fget, obj.fset, obj.fdel):
            yield from _codes(part, seen)
    elif isinstance(obj, functools.partial):
        for part in (obj.func, *obj.args, *obj.keywords.values()):
            yield from _codes(part, seen)
    elif isinstance(obj, type):
        for cls in obj.__mro__:
            for member in list(vars(cls).values()):
                yield from _codes(member, seen)


def _stub_in(code: types.CodeType) -> tuple[str, int | str] | None:
    """The stub in ``code`` or in a function nested in it: (qualified name, line)."""
    if "NotImplementedError" in code.co_names:
        for ins in dis.get_instructions(code):
            if isinstance(ins.argval, str) and ins.argval.startswith(STUB_PREFIX):
                line = next(
                    (n for start, end, n in code.co_lines() if start <= ins.offset < end), None
                )
                return getattr(code, "co_qualname", code.co_name), line or "?"
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            hit = _stub_in(const)
            if hit is not None:
                return hit
    return None
