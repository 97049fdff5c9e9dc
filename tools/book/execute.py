"""Execute a lesson once and keep the executed copy, keyed on everything that decides its output.

The key is a SHA-256 over the notebook's bytes, every file of the ``labkit`` package,
``pyproject.toml``, and the Python and torch versions: an executed copy is reused only while
none of those changed. The test suite executes each lesson through :func:`execute_to_cache`
(``tests/lessons/``), and the book reads the cache, so ``./run-tests`` runs every lesson once.
A lesson whose cell raises fails with the notebook, the cell's number, its source and the error.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".labkit" / "executed"  # .labkit/ is git-ignored
CELL_TIMEOUT = 900  # seconds; the slowest lesson cell takes under a minute on 2 cores


ANSI = re.compile(r"\x1b\[[0-9;]*m")


class LessonFailed(RuntimeError):
    """A lesson's cell raised: names the notebook, the cell and the error."""


@cache
def sources_digest() -> str:
    """SHA-256 over labkit's files (sorted by path) and pyproject.toml."""
    h = hashlib.sha256()
    files = sorted(p for p in (ROOT / "labkit").rglob("*") if p.is_file()
                   and "__pycache__" not in p.parts)  # fmt: skip
    for p in [*files, ROOT / "pyproject.toml"]:
        h.update(p.relative_to(ROOT).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(f"{sys.version} torch {_torch_version()}".encode())
    return h.hexdigest()


def _torch_version() -> str:
    from importlib.metadata import version

    return version("torch")


def notebook_key(path: Path) -> str:
    return hashlib.sha256(path.read_bytes() + sources_digest().encode()).hexdigest()


def cache_path(path: Path) -> Path:
    return CACHE / path.relative_to(ROOT).with_suffix(".ipynb")


def cached(path: Path) -> nbformat.NotebookNode | None:
    """The executed copy of ``path`` if its key still matches, else None."""
    out = cache_path(path)
    if not out.is_file():
        return None
    nb = nbformat.read(out, as_version=4)
    return nb if nb.metadata.get("labkit_book", {}).get("key") == notebook_key(path) else None


def execute(path: Path, km: Any = None) -> nbformat.NotebookNode:
    """Run every cell of ``path`` in a fresh kernel (``km``: a kernel manager not yet started,
    or None for the default one), in the notebook's folder, keeping each widget's state."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, km=km, kernel_name="python3", timeout=CELL_TIMEOUT,
                            store_widget_state=True,
                            resources={"metadata": {"path": str(path.parent)}})  # fmt: skip
    try:
        client.execute()
    except CellExecutionError as error:
        index = next((i for i, c in enumerate(nb.cells) if c.cell_type == "code"
                      and any(o.get("output_type") == "error" for o in c.get("outputs", []))),
                     None)  # fmt: skip
        where = f"cell {index}" if index is not None else "a cell"
        text = ANSI.sub("", str(error))
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        raise LessonFailed(f"{shown}: {where} raised\n{text}") from None
    return nb


def execute_to_cache(path: Path, km: Any = None) -> nbformat.NotebookNode:
    """Execute ``path`` unless a fresh executed copy exists; write the copy atomically into
    the private cache folder (created 0700; a copy is replaced by rename, never half-written)."""
    path = path.resolve()
    hit = cached(path)
    if hit is not None:
        return hit
    key = notebook_key(path)  # before running: a source edited meanwhile makes the copy stale
    nb = execute(path, km)
    nb.metadata["labkit_book"] = {"key": key}
    out = cache_path(path)
    CACHE.mkdir(mode=0o700, parents=True, exist_ok=True)
    out.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        nbformat.write(nb, f)
    os.replace(tmp, out)
    return nb
