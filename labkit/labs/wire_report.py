"""Print the counted messages of the miniature beside the planner's placement and bytes.

``python -m labkit.labs.wire_report`` runs :func:`labkit.labs.wire_count.count_layouts` and
:func:`~labkit.labs.wire_count.count_zero` on 4 gloo ranks, 2 nodes of 2 (``--emulated``: on an
emulated cluster, the software link model slowing what crosses nodes; the bytes are the
same), and ``--eight`` adds dp2 x tp2 x pp2 on 8 ranks, 2 nodes of 4. Three tables: per layout,
axis and priced term the link class and the bytes (counted, the largest rank or pipeline
boundary, and planned); every term the planner does not price (the bookkeeping: the loss's
per-token all-reduces, ZeRO's used flags), by name; each ZeRO stage's dp bytes. Bytes are
what a ring sends from one rank per step (``wire_count.wire_bytes``).
"""

from __future__ import annotations

import argparse
from typing import Any

from labkit.labs.wire_count import (
    ZERO_RUNS,
    WireConfig,
    WireLayout,
    compare,
    compare_zero,
    count_layouts,
    count_zero,
)
from labkit.launch import launch
from labkit.measure.wire_tally import PRICED
from labkit.parallel.layout import ParallelDegrees
from labkit.viz.table import Column, format_table

__all__ = ["main", "run", "summary", "unpriced"]


def _b(name: str) -> Column:
    return Column(name, "B", ",.0f")


def _term(rank: dict[str, Any], axis: str, term: str) -> float:
    """A rank's counted bytes of ``term`` on ``axis``."""
    return sum(v for (a, t, _), v in rank["counted"].items() if (a, t) == (axis, term))


def summary(cfg: WireConfig, results: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Rows (layout, axis, term, link counted, link planned, bytes counted, bytes planned):
    every term the planner prices, the largest rank's (pp's activations: the largest
    boundary's, both ways)."""
    rows = []
    for layout in cfg.layouts:
        c = compare(cfg, results, layout)
        for axis, (got, want) in c["placement"].items():
            link = ["inter" if place and place[1] > 1 else "intra" for place in (got, want)]
            for term in PRICED[axis]:
                if term == "activations":
                    counted = max(v for v, _ in c["pp"].values())
                    planned = max(w for _, w in c["pp"].values())
                else:
                    counted = max(_term(r, axis, term) for r in c["ranks"])
                    planned = max(r["planned"][term] for r in c["ranks"])
                rows.append((layout.name, axis, term, *link, counted, planned))
    return rows


def unpriced(cfg: WireConfig, results: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Rows (layout, axis, term, bytes, priced): every term the planner does not price (the
    bookkeeping, :data:`~labkit.measure.wire_tally.BOOKKEEPING`), the largest rank's bytes per
    step, beside the bytes the planner prices on that axis of the same rank."""
    rows = []
    for layout in cfg.layouts:
        ranks = compare(cfg, results, layout)["ranks"]
        terms = sorted({(a, t) for r in ranks for a, t, _ in r["counted"]
                        if t not in PRICED.get(a, ())})  # fmt: skip
        for axis, term in terms:
            per = [(_term(r, axis, term), sum(_term(r, axis, x) for x in PRICED.get(axis, ())))
                   for r in ranks]  # fmt: skip
            got, priced = max(per)
            rows.append((layout.name, axis, term, got, priced))
    return rows


def run(cfg: WireConfig, world_size: int = 4, zero: bool = True, **options: Any) -> list[Any]:
    """Launch the counts on ``world_size`` gloo ranks: per rank ``(layouts, zero runs)``."""
    for layout in cfg.layouts:
        layout.degrees.check_world_size(world_size)
    options.setdefault("timeout", 300)
    return launch(_both, cfg, zero, world_size=world_size, quiet=True, backend="gloo",
                  **options)  # fmt: skip


def _both(cfg: WireConfig, zero: bool) -> tuple[dict[str, Any], dict[Any, Any]]:
    return count_layouts(cfg), count_zero(cfg) if zero else {}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--emulated", action="store_true", help="software link model, 2 nodes")
    parser.add_argument("--eight", action="store_true", help="also dp2 tp2 pp2 on 8 ranks")
    args = parser.parse_args(argv)
    runs = [(WireConfig(), 4, True)]
    if args.eight:
        three = WireLayout("dp2 tp2 pp2", ParallelDegrees(2, 2, 2))
        runs.append((WireConfig(layouts=(three,), gpus_per_node=4), 8, False))
    link_rows, other_rows, zero_rows = [], [], []
    for cfg, world, zero in runs:
        options: dict[str, Any] = {}
        if args.emulated:
            from labkit.cluster import EmulatedCluster

            options["cluster"] = EmulatedCluster(2, inter_bandwidth=1e9, mode="software")
        out = run(cfg, world, zero, **options)
        layouts = [r[0] for r in out]
        link_rows += summary(cfg, layouts)
        other_rows += unpriced(cfg, layouts)
        for stage, tied in ZERO_RUNS if zero else ():
            c = compare_zero(cfg, out[0][1][(stage, tied)], stage, tied, world)
            zero_rows.append((stage, "tied" if tied else "untied", c["counted"], c["planned"],
                              c["formula"], c["untied_formula"], c["bookkeeping"]))  # fmt: skip
    heads: list[Column | str] = ["layout", "axis", "term", "link counted", "link planned",
                                 _b("counted"), _b("planned")]  # fmt: skip
    print(format_table(heads, link_rows, title="priced terms, per rank and step"))
    heads = ["layout", "axis", "term", _b("bytes"), _b("priced, same rank")]
    print("\n" + format_table(heads, other_rows, title="bookkeeping the planner does not price"))
    heads = ["stage", "embedding", _b("counted"), _b("planned"), _b("formula, real count"),
             _b("without the tied gather"), _b("used flags")]  # fmt: skip
    print("\n" + format_table(heads, zero_rows, title="dp alone on 4 ranks, per rank and step"))


if __name__ == "__main__":
    main()
