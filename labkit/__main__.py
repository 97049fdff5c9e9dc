"""Command line: ``python -m labkit info`` and ``python -m labkit run NOTEBOOK`` (headless lab)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any


def run_notebook(path: Path, timeout: int = 600) -> int:
    """Execute a notebook top to bottom in a fresh kernel, printing each cell's text output."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    code_cells = sum(c.cell_type == "code" for c in nb.cells)
    done = 0

    def show(cell: Any, cell_index: int, execute_reply: Any) -> None:
        nonlocal done
        done += 1
        print(f"\n--- cell {done}/{code_cells} ---", flush=True)
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                print(out.text, end="", flush=True)
            elif out.output_type in ("execute_result", "display_data"):
                data = out.get("data", {})
                if "image/png" in data:
                    print("[figure]")
                elif "text/plain" in data:
                    print(data["text/plain"])
            elif out.output_type == "error":
                print("\n".join(out.traceback))

    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.on_cell_executed = show
    start = time.monotonic()
    try:
        client.execute()
    except CellExecutionError:
        print(f"\n{path} FAILED after {time.monotonic() - start:.1f}s", file=sys.stderr)
        return 1
    print(f"\n{path}: all {code_cells} code cells ran in {time.monotonic() - start:.1f}s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="what this machine offers: torch, GPUs, backend")
    run = sub.add_parser("run", help="run a lab notebook headless and print its results")
    run.add_argument("notebook", type=Path)
    run.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args(argv)
    if args.command == "info":
        from labkit.launch import describe_machine

        for key, value in describe_machine().items():
            print(f"{key:>20}: {value}")
        return 0
    if not args.notebook.is_file():
        parser.error(f"no notebook at {args.notebook}")
    return run_notebook(args.notebook, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
