"""The README's pictures, taken from the lessons' executions: one lesson cell tagged
``readme:NAME`` draws ``docs/NAME.png``. The book's front page shows the picture from the very
execution its lessons show, and ``tools/render_figures.py`` writes the same bytes into docs/, so
the README, the book and the lessons cannot disagree about what a figure is.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import nbformat

from tools.book.execute import ROOT
from tools.book.static_widgets import STATE, VIEW

TAG = "readme:"
README_PICTURE = re.compile(r"!\[[^\]]*\]\(docs/([\w-]+)\.png\)")


def readme_pictures() -> list[str]:
    """Names of the pictures the README shows (``docs/NAME.png``)."""
    return README_PICTURE.findall((ROOT / "README.md").read_text())


def tagged_cells(paths: list[Path]) -> dict[str, tuple[Path, int]]:
    """``{NAME: (lesson, cell index)}`` for every cell tagged ``readme:NAME``; a name tagged
    twice is an error (one figure, one cell)."""
    found: dict[str, tuple[Path, int]] = {}
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            for tag in cell.metadata.get("tags", []):
                if tag.startswith(TAG):
                    name = tag.removeprefix(TAG)
                    if name in found:
                        raise ValueError(f"{TAG}{name} tags two cells: {found[name]} and "
                                         f"{(path, i)}")  # fmt: skip
                    found[name] = (path, i)
    return found


def first_image(nb: Any, index: int) -> bytes | None:
    """The first PNG the cell ``index`` shows, inside a widget's outputs included."""
    state = nb.metadata.get("widgets", {}).get(STATE, {}).get("state", {})
    for out in nb.cells[index].get("outputs", []):
        data = out.get("data", {})
        if "image/png" in data:
            return base64.b64decode(data["image/png"])
        if VIEW in data:
            found = _widget_image(data[VIEW]["model_id"], state)
            if found is not None:
                return found
    return None


def _widget_image(model_id: str, state: dict[str, Any]) -> bytes | None:
    s = state.get(model_id, {}).get("state", {})
    for out in s.get("outputs", []):
        if "image/png" in out.get("data", {}):
            return base64.b64decode(out["data"]["image/png"])
    for child in s.get("children", []):
        found = _widget_image(child.removeprefix("IPY_MODEL_"), state)
        if found is not None:
            return found
    return None


def readme_figures(executed: dict[Path, Any]) -> dict[str, bytes]:
    """``{NAME: png bytes}`` for every README picture, from the executed lessons; raises when a
    picture has no tagged cell or the cell drew nothing."""
    cells = tagged_cells(list(executed))
    missing = [n for n in readme_pictures() if n not in cells]
    if missing:
        raise ValueError(f"README pictures with no lesson cell tagged {TAG}NAME: {missing}")
    out = {}
    for name in readme_pictures():
        path, index = cells[name]
        png = first_image(executed[path], index)
        if png is None:
            raise ValueError(f"{path.name} cell {index} ({TAG}{name}) drew no picture")
        out[name] = png
    return out
