"""Say when the venv's torch is not the one LABKIT_TORCH asks for, and how to switch.

Run by ``tools/ensure_env.sh`` (every ``./lab``) and ``./lab --help`` with the venv's Python.
It reads installed metadata only: no torch import, no install. Exit status 0 always (a
mismatch is reported, not fatal); prints nothing when they agree or LABKIT_TORCH is unset.
"""

from __future__ import annotations

import os
import sys
from importlib import metadata


def _wanted(spec: str) -> str:
    """The requirement in LABKIT_TORCH: its first word ("torch==2.13.0"), pip options after."""
    return spec.split()[0] if spec.split() else ""


def mismatch(spec: str, installed: str | None) -> str | None:
    """The message for a venv whose torch ``installed`` does not satisfy ``spec``, else None."""
    want = _wanted(spec)
    if not want:
        return None
    if installed is None:
        return None  # ensure_env.sh installs LABKIT_TORCH into a venv without torch
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pragma: no cover - packaging ships with pip and jupyter
        return None
    try:
        req = Requirement(want)
    except ValueError:
        return (
            f"labkit: LABKIT_TORCH={spec!r} is not a pip requirement (expected e.g. torch==2.13.0)"
        )
    if req.specifier.contains(installed, prereleases=True):
        return None
    return (
        f"labkit: .venv has torch {installed}, but LABKIT_TORCH={spec!r} asks for {want}.\n"
        "  .venv keeps the torch it has (nothing is reinstalled behind your back). To switch:\n"
        f"    .venv/bin/python -m pip install --force-reinstall {spec}\n"
        "  or start afresh: rm -rf .venv && ./lab"
    )


def main() -> int:
    try:
        installed: str | None = metadata.version("torch")
    except metadata.PackageNotFoundError:
        installed = None
    msg = mismatch(os.environ.get("LABKIT_TORCH", ""), installed)
    if msg:
        print(msg, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
