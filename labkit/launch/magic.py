"""The ``%%ranks`` cell magic: a cell's body runs on every rank of a :class:`World`.

Creating a ``World`` inside IPython registers the magic and makes that world the default.
``%%ranks`` runs on the latest world; ``%%ranks w`` names one. Names a cell defines stay on
the ranks for the next ``%%ranks`` cell; when the last line is an expression, each rank's
value is printed as ``[rankN]: value``.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from labkit.launch.world import World

_latest: weakref.ref[World] | None = None


def register(world: World) -> None:
    """Make ``world`` the default of ``%%ranks`` (registering the magic in IPython)."""
    global _latest
    _latest = weakref.ref(world)
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython comes with Jupyter
        return
    shell = get_ipython()
    if shell is not None:
        shell.register_magic_function(ranks, magic_kind="cell", magic_name="ranks")


def ranks(line: str, cell: str) -> None:
    """``%%ranks [world]``: run the cell on every rank, print each rank's last value."""
    from IPython import get_ipython

    name = line.strip()
    world: Any = get_ipython().user_ns.get(name) if name else (_latest() if _latest else None)
    if world is None:
        raise NameError(
            f"%%ranks: no world named {name!r}"
            if name
            else "%%ranks needs a world: world = labkit.World(2)"
        )
    for rank, value in enumerate(world.exec(cell)):
        if value is not None:
            print("\n".join(f"[rank{rank}]: {part}" for part in repr(value).splitlines()))
