"""Draw a 3D-parallel layout: which global ranks form each tp, pp and dp group, node by node.

One picture per job: a grid with one row per node and one cell per GPU (global rank
``node * gpus_per_node + local``). Each cell shows its rank and ``(pp, dp, tp)`` index
(``(pp, dp, cp, tp)`` when cp > 1);
its colour is its pipeline stage, so Megatron's order shows at a glance: a tp group is a
run of adjacent cells inside one row (one node), a pp group jumps across rows (nodes).
:func:`layout_table` is the same information as text, and :func:`node_spans` the facts a
test checks without drawing.
"""

from __future__ import annotations

from typing import Any

from labkit.parallel.layout import ParallelDegrees, rank_grid

__all__ = ["draw_layout", "layout_table", "node_spans", "rank_coords"]


def rank_coords(degrees: ParallelDegrees) -> dict[int, tuple[int, ...]]:
    """Global rank -> its (pp, dp, tp) index, or (pp, dp, cp, tp) when cp > 1: the inverse of
    ``r = pp_idx (dp cp tp) + dp_idx (cp tp) + cp_idx tp + tp_idx`` (labkit.parallel.layout)."""
    cp, tp = degrees.cp, degrees.tp
    out: dict[int, tuple[int, ...]] = {}
    for r in range(degrees.world_size):
        pp_i, rest = divmod(r, degrees.dp * cp * tp)
        dp_i, rest = divmod(rest, cp * tp)
        cp_i, tp_i = divmod(rest, tp)
        out[r] = (pp_i, dp_i, cp_i, tp_i) if cp > 1 else (pp_i, dp_i, tp_i)
    return out


def node_spans(degrees: ParallelDegrees, gpus_per_node: int) -> dict[str, list[set[int]]]:
    """For every tp, dp and pp group: the set of nodes its ranks sit on."""
    return {
        axis: [{r // gpus_per_node for r in g} for g in groups]
        for axis, groups in rank_grid(degrees).items()
    }


def layout_table(degrees: ParallelDegrees, gpus_per_node: int) -> str:
    """One line per node: each GPU's global rank and (pp, dp, [cp,] tp) index; then the groups."""
    coords = rank_coords(degrees)
    lines = []
    for node in range(-(-degrees.world_size // gpus_per_node)):
        ranks = range(node * gpus_per_node, min((node + 1) * gpus_per_node, degrees.world_size))
        cells = " ".join(f"{r:>3}{coords[r]}".replace(" ", "") for r in ranks)
        lines.append(f"node {node}: {cells}")
    for axis, groups in rank_grid(degrees).items():
        shown = ", ".join(str(g) for g in groups[:4]) + (" ..." if len(groups) > 4 else "")
        lines.append(f"{axis} groups ({len(groups)} of {len(groups[0])}): {shown}")
    return "\n".join(lines)


def draw_layout(degrees: ParallelDegrees, gpus_per_node: int, ax: Any = None) -> Any:
    """The grid as a matplotlib figure: rows are nodes, cells GPUs coloured by pipeline
    stage, a box around every tp group; returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    coords = rank_coords(degrees)
    nodes = -(-degrees.world_size // gpus_per_node)
    if ax is None:
        _, ax = plt.subplots(figsize=(1.1 * gpus_per_node + 1, 0.7 * nodes + 1))
    cmap = plt.get_cmap("tab10")
    for r, xyz in coords.items():
        pp, dp, tp = xyz[0], xyz[1], xyz[-1]
        cp = f" cp{xyz[2]}" if len(xyz) == 4 else ""
        node, local = divmod(r, gpus_per_node)
        y = nodes - 1 - node
        ax.add_patch(Rectangle((local, y), 0.95, 0.9, color=cmap(pp % 10), alpha=0.55))
        ax.text(local + 0.47, y + 0.45, f"{r}\npp{pp} dp{dp}\n{cp.strip()} tp{tp}".replace(
                "\n ", "\n"), ha="center", va="center", fontsize=7)  # fmt: skip
    for group in rank_grid(degrees)["tp"]:
        node, first = divmod(group[0], gpus_per_node)
        same_row = all(g // gpus_per_node == node for g in group)
        if same_row:  # a tp group inside one node: one box around its adjacent cells
            box = Rectangle((first - 0.02, nodes - 1 - node - 0.03), len(group) - 0.01, 0.96,
                            fill=False, lw=2, ec="black")  # fmt: skip
            ax.add_patch(box)
    ax.set_xlim(-0.1, gpus_per_node)
    ax.set_ylim(-0.1, nodes)
    ax.set_yticks([nodes - 1 - n + 0.45 for n in range(nodes)], [f"node {n}" for n in range(nodes)])
    ax.set_xticks(
        [i + 0.47 for i in range(gpus_per_node)], [f"gpu {i}" for i in range(gpus_per_node)]
    )
    cps = f" x cp={degrees.cp}" if degrees.cp > 1 else ""
    ax.set_title(f"dp={degrees.dp}{cps} x tp={degrees.tp} x pp={degrees.pp}: colour = "
                 "pipeline stage, box = tp group")  # fmt: skip
    return ax.figure
