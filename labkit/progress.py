"""Progress bars for long cells: tqdm, notebook-aware, shown by rank 0 only.

``progress(range(steps), desc="train")`` wraps an iterable like ``tqdm``:

* in a Jupyter kernel it is tqdm's notebook widget;
* on a terminal, tqdm's usual bar;
* in a launched rank (stdout is a pipe streaming into a cell, one line at a time) a bar
  redrawn with ``\\r`` would show nothing until the end, so it prints a full line at most
  every ``mininterval`` seconds instead.

Every rank but rank 0 gets a disabled bar, so N ranks do not draw N bars. The rank is
``rank=`` when given, else the default group's rank when torch.distributed is initialised.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from tqdm import std as tqdm_std

__all__ = ["progress"]


class _LineBar(tqdm_std.tqdm):
    """tqdm that prints whole lines (for pipes that forward output line by line)."""

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        print(msg if msg is not None else self.__str__(), file=self.fp, flush=True)
        return True


def _in_kernel() -> bool:
    shell = sys.modules.get("IPython")
    if shell is None or "ipykernel" not in sys.modules:
        return False
    ip = shell.get_ipython()  # type: ignore[attr-defined]
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def progress(
    iterable: Iterable[Any] | None = None,
    total: int | None = None,
    desc: str | None = None,
    rank: int | None = None,
    mininterval: float = 2.0,
    **kwargs: Any,
) -> Any:
    """A progress bar over ``iterable`` (or ``total`` manual ``update`` calls), rank 0 only."""
    disable = (_rank() if rank is None else rank) != 0
    if _in_kernel():
        from tqdm.notebook import tqdm as notebook_tqdm

        return notebook_tqdm(iterable, total=total, desc=desc, disable=disable, **kwargs)
    if sys.stderr.isatty():
        return tqdm_std.tqdm(iterable, total=total, desc=desc, disable=disable, **kwargs)
    return _LineBar(
        iterable,
        total=total,
        desc=desc,
        disable=disable,
        mininterval=mininterval,
        file=sys.stdout,
        ascii=True,
        **kwargs,
    )
