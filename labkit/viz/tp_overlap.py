"""Pictures of overlapped tensor parallelism, drawn from real runs (``labkit.measure.tp_overlap``).

* :func:`draw_tp_timeline`: one row per rank; per ring step a thick bar for the chunk's GEMM
  ("compute" to "computed", step number inside) over a thin bar for the transfer in flight
  ("post" to its wait returning), one colour per decomposed collective. A thin bar under a
  thick one is communication under a matmul.
* :func:`draw_profile`: the profiler's view of one forward and backward of the plain and the
  overlapped layer: communication spans (gloo's messages, post to completion) over GEMM spans.
* :func:`draw_exposed`: median seconds per contender, split into the GEMMs' share (compute
  only) and the rest (exposed communication and overheads).
* :func:`overlap_predictions`: the planner's step per case without tp overlap, decomposed
  (:mod:`labkit.planner.tp_overlap`) and the whole-GEMM bound, as table rows.
"""

from __future__ import annotations

from typing import Any

from labkit.viz.context_parallel import draw_ring_trace

__all__ = [
    "OVERLAP_MODES",
    "draw_exposed",
    "draw_profile",
    "draw_tp_timeline",
    "overlap_predictions",
]

# the planner's tp_overlap values, as the notebook's table names them
OVERLAP_MODES: dict[str, bool | str] = {
    "none": False,
    "decomposed": "decomposed",
    "whole-GEMM bound": True,
}

PHASES = {
    "ag_fwd": ("tab:blue", "forward all-gather -> GEMM"),
    "rs_fwd": ("tab:green", "forward GEMM -> reduce-scatter"),
    "ag_bwd": ("tab:orange", "backward all-gather -> dX GEMM"),
    "rs_bwd": ("tab:red", "backward dX GEMM -> reduce-scatter"),
}


def draw_tp_timeline(per_rank: list[list[tuple[str, int, str, float]]], ax: Any = None) -> Any:
    """``per_rank[r]``: rank r's events (``measure.tp_overlap.layer_timeline``). The figure."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.9 * len(per_rank) + 1.2))
    title = "overlapped SP layer: chunk GEMMs (thick, step) over ring transfers (thin)"
    draw_ring_trace(per_rank, ax, {ph: c for ph, (c, _) in PHASES.items()}, title)
    ax.set_xlabel("ms since the first ring event")
    return ax.figure


def draw_profile(profile: dict[str, Any], ax: Any = None) -> Any:
    """``profile``: one rank's :func:`labkit.measure.tp_overlap.profile_layer`. The figure."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 2.6))
    labels = []
    for i, name in enumerate(("plain", "overlapped")):
        p = profile[name]
        y = 2 * i
        ax.broken_barh([(s * 1e3, (e - s) * 1e3) for s, e in p["gemm"]], (y + 0.1, 0.8),
                       color="tab:gray")  # fmt: skip
        ax.broken_barh([(s * 1e3, (e - s) * 1e3) for s, e in p["comm"]], (y + 1.05, 0.8),
                       color="tab:purple", alpha=0.7)  # fmt: skip
        labels += [f"{name}: GEMMs", f"{name}: messages in flight"]
    ax.set_yticks([0.5, 1.45, 2.5, 3.45], labels)
    ax.set_xlabel("ms since the layer's first profiled op (one forward and backward)")
    ax.set_title("torch.profiler: communication (gloo:*) against GEMMs (aten::mm/addmm)")
    return ax.figure


def draw_exposed(result: dict[str, Any], ax: Any = None) -> Any:
    """``result``: one rank's :func:`labkit.measure.tp_overlap.measure_overlap`. The figure."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 2.8))
    med = result["median"]
    names = ["compute only", "comm only", "plain", "overlapped"]
    base = [med["compute only"] if n in ("plain", "overlapped") else med[n] for n in names]
    rest = [med[n] - b for n, b in zip(names, base)]
    ax.barh(names, [b * 1e3 for b in base], color="tab:gray", label="GEMMs (compute only)")
    ax.barh(names, [x * 1e3 for x in rest], left=[b * 1e3 for b in base], color="tab:purple",
            label="exposed: communication + overheads")  # fmt: skip
    ax.set_xlabel("ms per forward + backward (median)")
    ax.legend(fontsize=7, loc="lower right")
    return ax.figure


def overlap_predictions(cases: dict[str, tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Rows (case, mode, tp comm s, step s, MFU) for ``cases[name] = (cfg, cluster,
    global_batch, candidate)``, one per :data:`OVERLAP_MODES` entry."""
    from labkit.planner import predict

    rows = []
    for name, (cfg, cluster, batch, cand) in cases.items():
        for mode, value in OVERLAP_MODES.items():
            p = predict(cfg, cluster, batch, cand, tp_overlap=value)
            rows.append((name, mode, p.time["tp_comm"], p.step_seconds, p.mfu))
    return rows
