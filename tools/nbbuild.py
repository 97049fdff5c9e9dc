#!/usr/bin/env python3
"""Build an .ipynb (no outputs) from py-percent text: a quick way to author a notebook.

Cells start at lines ``# %%`` (code) or ``# %% [markdown]`` (markdown; each line's leading
``# `` is removed). Tags: ``# %% tags=["keep_output"]``. The .ipynb is what gets committed.

Usage: python tools/nbbuild.py source.py notebooks/NN_topic.ipynb
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import nbformat

HEADER = re.compile(r"^# %%(?P<md>\s*\[markdown\])?(?:\s*tags=(?P<tags>\[.*\]))?\s*$")


def build(text: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "display_name": "Python 3",
        "language": "python",
        "name": "python3",
    }
    nb.metadata["language_info"] = {"name": "python"}
    kind, tags, lines = None, [], []  # type: ignore[var-annotated]

    def flush() -> None:
        if kind is None:
            return
        body = "\n".join(lines).strip("\n")
        if kind == "markdown":
            body = "\n".join(re.sub(r"^# ?", "", line) for line in body.splitlines())
            cell = nbformat.v4.new_markdown_cell(body)
        else:
            cell = nbformat.v4.new_code_cell(body)
        if tags:
            cell.metadata["tags"] = tags
        nb.cells.append(cell)

    for line in text.splitlines():
        m = HEADER.match(line)
        if m:
            flush()
            kind = "markdown" if m["md"] else "code"
            tags = json.loads(m["tags"]) if m["tags"] else []
            lines = []
        elif kind is not None:
            lines.append(line)
    flush()
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i:02d}"
    return nb


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    nb = build(Path(sys.argv[1]).read_text())
    nbformat.validate(nb)
    Path(sys.argv[2]).write_text(nbformat.writes(nb) + "\n")
    print(f"wrote {sys.argv[2]} ({len(nb.cells)} cells)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
