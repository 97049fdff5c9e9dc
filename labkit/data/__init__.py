"""Real data that ships with labkit, so a fresh clone trains offline (see files/SHA256SUMS)."""

from __future__ import annotations

from pathlib import Path

FILES = Path(__file__).resolve().parent / "files"


def shipped(relative: str) -> Path:
    """Path of a file shipped under ``labkit/data/files``; a clear error if it is missing."""
    path = FILES / relative
    if not path.is_file():
        raise FileNotFoundError(f"labkit's shipped data file is missing: {path}")
    return path
