"""The one way tests run work on N ranks when they do not test process life itself.

Equivalence, collectives and memory tests call :func:`run_ranks`; tests of launching, killing,
hangs and interrupts call ``labkit.launch`` directly.

``run_ranks`` shares one warm :class:`labkit.World` per (world size, backend, env) across the
whole pytest session (started on first use, closed at session end by ``conftest.py``), which
turns a launch of seconds into a call of milliseconds. Isolation between calls is real:

* every call starts barrier-synchronised, with a fresh process's torch seed, grad mode and
  default dtype; the subgroups it created (``new_group``, a DeviceMesh's groups) are
  destroyed after it, and its ``os.environ`` and working-directory changes undone;
* ``fn`` travels by value with fresh module globals: a test module is pickled by value, so
  a call never sees globals a previous call set (state inside *imported* library modules,
  labkit's or torch's, does persist: tests must not rely on it either way);
* a call that breaks the world (a raise mid-collective, a timeout, a dead rank, a destroyed
  default group) makes the next call start a fresh one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import cloudpickle

from labkit import World, launch

_WORLDS: dict[tuple[Any, ...], World] = {}


def run_ranks(
    fn: Callable[..., Any], *args: Any, world_size: int, timeout: float = 120, **kwargs: Any
) -> list[Any]:
    """``fn(*args)`` on ``world_size`` gloo ranks (CPU tensors), bounded by ``timeout`` seconds;
    returns the per-rank results, indexed by rank.

    ``quiet`` (default True), ``backend`` (default gloo) and ``env`` are honoured; any other
    launch option (``max_restarts``, ``collective_timeout``, ...) means a fresh launch.
    """
    quiet = kwargs.pop("quiet", True)
    backend = kwargs.pop("backend", "gloo")
    env = kwargs.pop("env", None) or {}
    if kwargs:
        return launch(
            fn,
            *args,
            world_size=world_size,
            timeout=timeout,
            quiet=quiet,
            backend=backend,
            env=env,
            **kwargs,
        )
    _by_value(fn)
    key = (world_size, backend, tuple(sorted(env.items())))
    world = _WORLDS.get(key)
    if world is None:
        # The world's collectives get a generous bound; each call's own timeout is enforced
        # by the caller (a hang there stops the world, and the next call gets a fresh one).
        world = World(world_size, backend=backend, timeout=max(timeout, 600), quiet=True, env=env)
        _WORLDS[key] = world
    return world.run(fn, *args, timeout=timeout, quiet=quiet, isolate=True)


def _by_value(fn: Callable[..., Any]) -> None:
    """Pickle ``fn``'s test module by value, so every call rebuilds its globals afresh; a
    module holding something unpicklable at top level falls back to pickling by reference."""
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    if module is None or module.__name__.split(".")[0] != "tests":
        return
    cloudpickle.register_pickle_by_value(module)
    try:
        cloudpickle.dumps(fn)
    except Exception:  # noqa: BLE001 - by reference still works, with shared module state
        cloudpickle.unregister_pickle_by_value(module)


def value_errors(attempts: list[Callable[[], object]]) -> list[str]:
    """The ValueError message of each attempt ("no error" if it raised none): what the
    bad-argument tests compare across ranks (the same clear error on every rank)."""
    errors = []
    for attempt in attempts:
        try:
            attempt()
            errors.append("no error")
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def close_worlds() -> None:
    """End every shared world (the session fixture calls this at the end of the run)."""
    while _WORLDS:
        _WORLDS.popitem()[1].close()
