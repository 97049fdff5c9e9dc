"""The planner against Narayanan et al. 2021, Table 1, row by row (pure arithmetic)."""

from __future__ import annotations

from labkit.models.gpt import GPTConfig
from labkit.planner.cluster import CLUSTERS
from labkit.planner.flops import (
    MEGATRON_TABLE1,
    TABLE1_SEQ,
    TABLE1_VOCAB,
    megatron_flops_per_iteration,
)
from labkit.planner.plan import plan

__all__ = ["compare_table1"]


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
