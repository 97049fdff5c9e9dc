"""The planner against Narayanan et al. 2021, Table 1, row by row (pure arithmetic)."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from labkit.models.gpt import GPTConfig
from labkit.planner.cluster import CLUSTERS
from labkit.planner.flops import (
    MEGATRON_TABLE1,
    TABLE1_SEQ,
    TABLE1_VOCAB,
    megatron_flops_per_iteration,
)
from labkit.planner.plan import plan

__all__ = ["Table1Agreement", "compare_table1", "format_table1_agreement", "table1_agreement"]


def compare_table1(efficiency: float = 0.5) -> list[dict[str, object]]:
    """Row by row: the paper's (t, p) and achieved TFLOP/s per GPU against the planner's first
    choice and its predicted TFLOP/s (the paper's FLOPs, recompute included, over the predicted
    iteration time). Searches what the paper searched: t, p and micro-batch, full recompute,
    no ZeRO, no interleaving."""
    rows = []
    for row in MEGATRON_TABLE1:
        cfg = GPTConfig(
            vocab_size=TABLE1_VOCAB,
            block_size=TABLE1_SEQ,
            n_layer=row.layers,
            n_head=row.heads,
            n_embd=row.hidden,
        )
        preds = [
            r
            for r in plan(
                cfg,
                CLUSTERS["dgx-a100-80gb"].with_nodes(row.gpus // 8),
                row.batch,
                efficiency=efficiency,
            )
            if r.fits
        ]
        order = list(dict.fromkeys((r.candidate.tp, r.candidate.pp) for r in preds))
        best = preds[0]
        flops = megatron_flops_per_iteration(
            row.batch, TABLE1_SEQ, row.layers, row.hidden, TABLE1_VOCAB
        )
        rows.append(
            {
                "params (B)": row.params_billion,
                "paper (t, p)": (row.tp, row.pp),
                "planner (t, p)": (best.candidate.tp, best.candidate.pp),
                "paper's rank in planner": order.index((row.tp, row.pp)) + 1,
                "paper TFLOP/s": row.tflops_per_gpu,
                "planner TFLOP/s": round(flops / (best.step_seconds * row.gpus) / 1e12, 1),
            }
        )
    return rows


@dataclass(frozen=True)
class Table1Agreement:
    """What of Table 1 the planner reproduces, and what not (``table1_agreement``)."""

    rows: int
    first_choice_matches: int  # rows whose planner first choice is the paper's (t, p)
    worst_rank: int  # the paper's layout is among the planner's first ``worst_rank``
    max_tflops_error: float  # largest |planner / paper - 1| of TFLOP/s per GPU
    paper_tflops: tuple[float, float]  # smallest model's row, largest's
    planner_tflops: tuple[float, float]


def table1_agreement(rows: list[dict[str, object]] | None = None) -> Table1Agreement:
    """Count, from ``compare_table1``'s rows, what agrees with the paper and what does not."""
    rows = compare_table1() if rows is None else rows
    paper = [float(str(r["paper TFLOP/s"])) for r in rows]
    ours = [float(str(r["planner TFLOP/s"])) for r in rows]
    return Table1Agreement(
        rows=len(rows),
        first_choice_matches=sum(r["paper (t, p)"] == r["planner (t, p)"] for r in rows),
        worst_rank=max(int(str(r["paper's rank in planner"])) for r in rows),
        max_tflops_error=max(abs(o / p - 1) for o, p in zip(ours, paper)),
        paper_tflops=(paper[0], paper[-1]),
        planner_tflops=(ours[0], ours[-1]),
    )


def format_table1_agreement(rows: list[dict[str, object]] | None = None) -> str:
    """One paragraph a lesson prints: what of Megatron's Table 1 holds, and what does not."""
    a = table1_agreement(rows)
    pt, ot = a.paper_tflops, a.planner_tflops
    return textwrap.fill(
        f"Megatron Table 1 (Narayanan et al. 2021), {a.rows} rows: the planner's first "
        f"choice is the paper's (t, p) in {a.first_choice_matches} of {a.rows}, and the "
        f"paper's is among its first {a.worst_rank} in every row; TFLOP/s per GPU within "
        f"{a.max_tflops_error:.0%} of the paper's in every row, but the trend runs the "
        f"other way (paper {pt[0]:.0f} -> {pt[1]:.0f} from the smallest model to the largest, "
        f"planner {ot[0]:.0f} -> {ot[1]:.0f}: one matmul efficiency for every size).",
        width=92,
    )
