"""The ``%%ranks`` cell magic: a cell's body runs on every rank of a :class:`World`.

Importing labkit inside IPython registers the magic (``labkit.launch`` calls
:func:`register_in_ipython`; ``%load_ext labkit.launch.magic`` does the same by hand).
``%%ranks`` runs on the latest world created (:meth:`World.latest`); ``%%ranks w`` names one.
Names a cell defines stay on the ranks for the next ``%%ranks`` cell; when the last line is
an expression, each rank's value is printed as ``[rankN]: value``.

Imports run one way: this module knows :class:`World`; ``world.py`` knows nothing of magics.
"""

from __future__ import annotations

import sys
from typing import Any

from labkit.launch.world import World


def register_in_ipython() -> None:
    """Register ``%%ranks`` in the running IPython shell, when there is one."""
    ipython = sys.modules.get("IPython")  # never import IPython into a script or a rank
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None:
        load_ipython_extension(shell)


def load_ipython_extension(shell: Any) -> None:
    """IPython's extension hook: ``%load_ext labkit.launch.magic``."""
    shell.register_magic_function(ranks, magic_kind="cell", magic_name="ranks")


def ranks(line: str, cell: str) -> None:
    """``%%ranks [world]``: run the cell on every rank, print each rank's last value."""
    from IPython import get_ipython

    name = line.strip()
    world: Any = get_ipython().user_ns.get(name) if name else World.latest()
    if world is None:
        raise NameError(
            f"%%ranks: no world named {name!r}"
            if name
            else "%%ranks needs a world: world = labkit.World(2)"
        )
    for rank, value in enumerate(world.exec(cell)):
        if value is not None:
            print("\n".join(f"[rank{rank}]: {part}" for part in repr(value).splitlines()))
