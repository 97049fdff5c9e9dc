"""The one hardware and assumption catalog: every figure a lesson, the planner or an interview
answer takes from a data sheet, a published run or a stated assumption, by name, with its source.

The data is ``labkit/data/files/hardware.json``; this module only reads and types it. It
imports nothing of labkit, so every floor (techniques, planner, labs, interview, notebooks) may
read it. Names are ``"<card or topic>.<quantity>"``: ``a100.peak_bf16``,
``a100.nvlink_per_direction``, ``link.ib_latency``, ``s6.restart_seconds``... Values are SI
(bytes, bytes/s, FLOP/s, seconds). Bands (``a100.mfu``) are published ranges a prediction is
printed beside.

    >>> from labkit.hardware import value, cite
    >>> value("a100.peak_bf16")
    312000000000000.0
    >>> cite("a100.nvlink_per_direction", 1e9, "GB/s")
    '300 GB/s (a100.nvlink_per_direction)'

Invariant: every entry and band has a non-empty source and unit, values are finite and
positive, a band's low <= high (checked at load; a bad file raises naming the entry).
``tests/test_hardware_catalog.py`` fails on a hardware literal anywhere else in labkit/ or in
the notebooks.
"""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["Band", "Entry", "band", "bands", "cite", "entries", "entry", "value"]

PATH = Path(__file__).parent / "data" / "files" / "hardware.json"


@dataclass(frozen=True)
class Entry:
    """One figure: ``value`` in ``unit``, ``what`` it is, and where it comes from."""

    name: str
    value: float
    unit: str
    what: str
    source: str

    def __post_init__(self) -> None:
        if not (math.isfinite(self.value) and self.value > 0):
            raise ValueError(f"catalog entry {self.name!r}: value must be finite and > 0, "
                             f"got {self.value!r}")  # fmt: skip
        if not (self.unit and self.source and self.what):
            raise ValueError(f"catalog entry {self.name!r} needs unit, what and source")

    def cite(self, scale: float = 1.0, unit: str | None = None, fmt: str = ".0f") -> str:
        """``"<value / scale> <unit> (<name>)"``: the figure as prose says it, named."""
        return f"{self.value / scale:{fmt}} {self.unit if unit is None else unit} ({self.name})"


@dataclass(frozen=True)
class Band:
    """A published range (``low`` to ``high``) a prediction is shown beside."""

    name: str
    low: float
    high: float
    unit: str
    what: str
    source: str
    short: str  # who published it, for a printed line

    def __post_init__(self) -> None:
        if not (0 < self.low <= self.high) or not (self.unit and self.source and self.what):
            raise ValueError(f"catalog band {self.name!r}: need 0 < low <= high and unit, what, "
                             f"source; got {self.low!r}..{self.high!r}")  # fmt: skip

    def contains(self, x: float) -> bool:
        return self.low <= x <= self.high

    def verdict(self, x: float) -> str:
        """``"within"``, ``"above"`` or ``"below"`` the band."""
        return "within" if self.contains(x) else ("above" if x > self.high else "below")

    def cite(self) -> str:
        """``"52-56% published (Megatron-LM 2021, ...; a100.mfu)"``."""
        return f"{self.low * 100:.0f}-{self.high:.0%} published ({self.short}; {self.name})"


@cache
def _raw(path: Path = PATH) -> dict[str, Any]:
    return json.loads(path.read_text())


def _parse(raw: dict[str, Any]) -> tuple[dict[str, Entry], dict[str, Band]]:
    ent = {k: Entry(k, float(v["value"]), v["unit"], v["what"], v["source"])
           for k, v in raw["entries"].items()}  # fmt: skip
    bnd = {k: Band(k, float(v["low"]), float(v["high"]), v["unit"], v["what"], v["source"],
                v["short"])
           for k, v in raw.get("bands", {}).items()}  # fmt: skip
    return ent, bnd


@cache
def _catalog() -> tuple[dict[str, Entry], dict[str, Band]]:
    return _parse(_raw())


def entries() -> dict[str, Entry]:
    """Every entry by name (a copy: the catalog cannot be edited at run time)."""
    return dict(_catalog()[0])


def bands() -> dict[str, Band]:
    return dict(_catalog()[1])


def _unknown(name: str, known: dict[str, Any]) -> KeyError:
    near = difflib.get_close_matches(name, list(known), n=3)
    return KeyError(f"{name!r} is not in the hardware catalog ({PATH.name}); close: {near}")


def entry(name: str) -> Entry:
    """The entry ``name``; a name not in the catalog raises, naming the closest ones."""
    got = _catalog()[0].get(name)
    if got is None:
        raise _unknown(name, _catalog()[0])
    return got


def value(name: str) -> float:
    """The value of entry ``name`` in SI units."""
    return entry(name).value


def band(name: str) -> Band:
    got = _catalog()[1].get(name)
    if got is None:
        raise _unknown(name, _catalog()[1])
    return got


def cite(name: str, scale: float = 1.0, unit: str | None = None, fmt: str = ".0f") -> str:
    """:meth:`Entry.cite` of entry ``name``: e.g. ``cite("a100.nic_bandwidth", 1e9, "GB/s")``
    is ``"25 GB/s (a100.nic_bandwidth)"``."""
    return entry(name).cite(scale, unit, fmt)
