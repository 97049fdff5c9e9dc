"""Plain-text tables with units: the one way notebooks print rows, mappings and configs.

Invariants, so a table reads the same in every notebook and in any browser width:
- every header names its unit, ``"step (ms)"``: a number never stands without one;
- a value is ``scale * raw`` formatted with the column's format spec (``scale=1e3`` turns
  seconds into ms), so a notebook never does unit arithmetic inline;
- a missing or non-finite value (``None``, ``nan``, ``inf``) prints as the column's ``missing``
  text (by default ``"n/a"``), never as a bare ``nan``;
- each column is as wide as its widest cell, so no row overflows its column; text columns
  align left, numbers right; no line is longer than header + cells + 2 spaces per gap.

``fields`` turns a dataclass (``Candidate``, ``GPTConfig``) or a mapping into one readable
line instead of its ``repr``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Any

__all__ = ["Column", "fields", "format_table", "mapping_table"]


@dataclass(frozen=True)
class Column:
    """One column: ``name`` and ``unit`` make the header, ``fmt`` (a format spec such as
    ``".2f"``, ``",.0f"`` or ``".0%"``) and ``scale`` the cells."""

    name: str
    unit: str = ""
    fmt: str = ""
    scale: float = 1.0
    missing: str = "n/a"

    @property
    def header(self) -> str:
        return f"{self.name} ({self.unit})" if self.unit else self.name

    def cell(self, value: Any) -> str:
        if value is None:
            return self.missing
        if isinstance(value, Real) and not isinstance(value, bool):
            x = float(value) * self.scale if self.scale != 1.0 else value
            if not math.isfinite(float(x)):
                return self.missing
            return format(x, self.fmt)
        return str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def format_table(
    columns: Sequence[Column | str], rows: Sequence[Sequence[Any]], *, title: str = ""
) -> str:
    """The rows under a header, each column as wide as its widest cell.

    A row must have one value per column: a short or long row is a ``ValueError`` naming the
    row, since a silently shifted column is worse than no table.
    """
    cols = [c if isinstance(c, Column) else Column(c) for c in columns]
    cells: list[list[str]] = []
    numeric = [True] * len(cols)
    for i, row in enumerate(rows):
        if len(row) != len(cols):
            raise ValueError(
                f"row {i} has {len(row)} values for {len(cols)} columns "
                f"{[c.header for c in cols]}: {list(row)!r}"
            )
        cells.append([c.cell(v) for c, v in zip(cols, row)])
        for j, v in enumerate(row):
            if v is not None and not _is_number(v):
                numeric[j] = False
    widths = [max([len(c.header)] + [len(r[j]) for r in cells]) for j, c in enumerate(cols)]

    def line(parts: Sequence[str]) -> str:
        out = [p.rjust(w) if num else p.ljust(w) for p, w, num in zip(parts, widths, numeric)]
        return "  ".join(out).rstrip()

    head = line([c.header for c in cols])
    body = [head, "-" * len(head)] + [line(r) for r in cells]
    return "\n".join(([title] if title else []) + body)


def mapping_table(
    values: Mapping[Any, Any], column: Column, *, key: str = "", title: str = ""
) -> str:
    """A mapping as a two-column table: its keys, then its values in ``column``'s unit."""
    return format_table(
        [Column(key or "name"), column], [(str(k), v) for k, v in values.items()], title=title
    )


def fields(obj: Any, *, only: Sequence[str] = (), units: Mapping[str, str] | None = None) -> str:
    """``name=value`` pairs of a dataclass or mapping on one line (``only``: these, in order).

    Floats print with up to 4 significant digits, integers with thousands separators, and a
    name in ``units`` gets its unit appended: ``"micro_batch=1  lr=0.0003  memory=80 GB"``.
    """
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    elif isinstance(obj, Mapping):
        items = dict(obj)
    else:
        raise TypeError(f"fields() takes a dataclass instance or a mapping, not {type(obj)!r}")
    names = list(only) or list(items)
    missing = [n for n in names if n not in items]
    if missing:
        raise KeyError(f"{type(obj).__name__} has no field(s) {missing}; it has {list(items)}")
    units = units or {}
    out = []
    for n in names:
        v = items[n]
        if isinstance(v, bool) or not _is_number(v):
            text = str(v)
        elif isinstance(v, int):
            text = f"{v:,}"
        else:
            text = "n/a" if not math.isfinite(v) else f"{v:.4g}"
        out.append(f"{n}={text}" + (f" {units[n]}" if n in units else ""))
    return "  ".join(out)
