"""The drills' fault table, read from ``drills_faults.json`` (data, not code).

Each fault has a ``name``, what is ``injected``, the breakdown category it ``shows_up_in``
(the one that grows the most, or the count that tells), its ``fix`` and whether it is
``cuda_only``, with an optional ``note`` on what the device changes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FAULTS_PATH", "Fault", "load_faults", "FAULT_INFO", "FAULTS", "CUDA_ONLY", "SIGNATURE"]

FAULTS_PATH = Path(__file__).resolve().parent / "drills_faults.json"


@dataclass(frozen=True)
class Fault:
    name: str
    injected: str
    shows_up_in: str
    fix: str
    cuda_only: bool = False
    note: str = ""  # what the device changes, where it matters


def load_faults(path: str | Path = FAULTS_PATH) -> dict[str, Fault]:
    """Every fault of the file, in file order; a missing field is an error naming the fault."""
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    out: dict[str, Fault] = {}
    for item in raw["faults"]:
        missing = [k for k in ("name", "injected", "shows_up_in", "fix") if k not in item]
        if missing:
            raise ValueError(f"{path}: fault {item.get('name', '?')!r} lacks {missing}")
        out[item["name"]] = Fault(
            item["name"],
            item["injected"],
            item["shows_up_in"],
            item["fix"],
            bool(item.get("cuda_only", False)),
            item.get("note", ""),
        )
    return out


FAULT_INFO = load_faults()
FAULTS = tuple(FAULT_INFO)
CUDA_ONLY = frozenset(f.name for f in FAULT_INFO.values() if f.cuda_only)
# fault -> (the breakdown category that grows the most, or the count that tells, and the fix)
SIGNATURE: dict[str, tuple[str, str]] = {
    f.name: (f.shows_up_in, f.fix) for f in FAULT_INFO.values()
}
