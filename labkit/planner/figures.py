"""Figures 12-16 of Narayanan et al. 2021 as data, and the planner's order against the measured one.

Each figure sweeps one choice at fixed model, GPUs and batch; its settings are NVIDIA's
reproduction scripts (github.com/NVIDIA/Megatron-LM ``examples/sc21/run_figure_1N.sh``, with
``CONFIG.sh``'s ``--fp16``; all ``--DDP-impl local``, full recompute, micro-batch 1 unless swept)
and the measured order is what the paper's text says of the figure (arXiv 2104.04473, section
5.3-5.5), quoted in :data:`FIGURES`. The planner prices every point as Megatron 2021 ran it
(:func:`labkit.planner.sc21.predict_2021`) and :func:`figure_orders` says, per figure and batch,
whether its order is the measured one. Nothing here is fitted to a figure.
"""

from __future__ import annotations

from typing import NamedTuple

from labkit.planner.plan import Candidate
from labkit.planner.sc21 import predict_2021, sc21_model

__all__ = ["FIGURES", "Figure", "figure_orders", "figure_points"]


class Figure(NamedTuple):
    name: str
    model: tuple[int, int, int]  # layers, hidden, heads
    gpus: int
    batches: tuple[int, ...]
    # the swept points: (label, tp, pp, micro_batch, virtual)
    points: tuple[tuple[str, int, int, int, int], ...]
    check: str  # "first": the first point is fastest; "descending": measured fastest to slowest;
    #             "first-gap-closes": the first wins at every batch, by less at the largest
    measured: str  # what the paper says, and where
    script: str


FIGURES: tuple[Figure, ...] = (
    Figure(
        "Figure 12: interleaved vs 1F1B, GPT 175B on 96 GPUs",
        (96, 12288, 96),
        96,
        (12, 24, 36, 48, 60),
        (("interleaved v=4", 8, 12, 1, 4), ("1F1B", 8, 12, 1, 1)),
        "first-gap-closes",
        "section 5.3: the interleaved schedule with scatter/gather is faster than the "
        "default schedule, and 'this gap closes as the batch size increases'",
        "run_figure_12.sh: t=8 p=12 MBS=1, --num-layers-per-virtual-pipeline-stage 2",
    ),
    Figure(
        "Figure 13: tensor vs pipeline, GPT 161B (162.2B) on 64 GPUs",
        (32, 20480, 128),
        64,
        (32, 128),
        (
            ("(8, 8)", 8, 8, 1, 1),
            ("(2, 32)", 2, 32, 1, 1),
            ("(4, 16)", 4, 16, 1, 1),
            ("(16, 4)", 16, 4, 1, 1),
            ("(32, 2)", 32, 2, 1, 1),
        ),
        "first",
        "section 5.4.1: peak performance when the tensor-parallel size equals the GPUs in a "
        "node (8), i.e. (t, p) = (8, 8), at both batch sizes",
        "run_figure_13.sh: t = 64 / p, MBS=1, batch 32 and 128",
    ),
    Figure(
        "Figure 14: pipeline vs data, GPT 5.9B on 64 GPUs",
        (32, 3840, 32),
        64,
        (32, 512),
        tuple((f"p={p}", 1, p, 1, 1) for p in (2, 4, 8, 16, 32)),
        "descending",
        "section 5.4.2: throughput decreases as the pipeline-parallel size increases, at "
        "each batch size",
        "run_figure_14.sh: t=1, dp = 64 / p, MBS=1, --checkpoint-activations, batch 32, 512",
    ),
    Figure(
        "Figure 15: tensor vs data, GPT 5.9B on 64 GPUs",
        (32, 3840, 32),
        64,
        (32, 128, 512),
        tuple((f"t={t}", t, 1, 1, 1) for t in (2, 4, 8, 16, 32)),
        "descending",
        "section 5.4.3: throughput decreases as the tensor-parallel size increases, at each "
        "batch size",
        "run_figure_15.sh: p=1, dp = 64 / t, MBS=1, --checkpoint-activations, batch 32, 128, 512",
    ),
    Figure(
        "Figure 16: micro-batch size, GPT 91B on 64 GPUs at (8, 8)",
        (32, 15360, 128),
        64,
        (128, 512),
        tuple((f"b={b}", 8, 8, b, 1) for b in (2, 1, 4, 8)),
        "first",
        "section 5.5: 'the best microbatch size is 2 for this model', at both batch sizes",
        "run_figure_16.sh: t=8 p=8, MBS 1, 2, 4, 8, batch 128 and 512",
    ),
)


def figure_points(fig: Figure, batch: int) -> dict[str, float]:
    """``{label: predicted TFLOP/s per GPU}`` (the 96-factor count) of every point at ``batch``."""
    from labkit.planner.flops import TABLE1_SEQ, TABLE1_VOCAB, megatron_flops_per_iteration

    layers, hidden, heads = fig.model
    cfg = sc21_model(layers, hidden, heads)
    flops = megatron_flops_per_iteration(batch, TABLE1_SEQ, layers, hidden, TABLE1_VOCAB)
    out = {}
    for label, t, p, b, v in fig.points:
        cand = Candidate(fig.gpus // (t * p), t, p, b, virtual=v)
        pred = predict_2021(cfg, fig.gpus, batch, cand)
        out[label] = flops / (pred.step_seconds * fig.gpus) / 1e12
    return out


def _holds(fig: Figure, runs: dict[int, dict[str, float]]) -> bool:
    labels = [pt[0] for pt in fig.points]
    if fig.check == "descending":
        return all([r[k] for k in labels] == sorted(r.values(), reverse=True)
                   for r in runs.values())  # fmt: skip
    firsts = all(max(r, key=r.__getitem__) == labels[0] for r in runs.values())
    if fig.check == "first":
        return firsts
    gaps = [r[labels[0]] / r[labels[1]] - 1 for r in runs.values()]  # by batch, ascending
    return firsts and gaps[-1] < gaps[0]


def figure_orders() -> list[dict[str, object]]:
    """Per figure: the planner's TFLOP/s of every point at every batch, its order (fastest
    first) and whether that is the measured order (``Figure.check``)."""
    out = []
    for fig in FIGURES:
        runs = {b: figure_points(fig, b) for b in fig.batches}
        out.append({
            "figure": fig.name, "measured": fig.measured,
            "planner order": {b: sorted(r, key=r.__getitem__, reverse=True)
                              for b, r in runs.items()},
            "TFLOP/s": {b: {k: round(x, 1) for k, x in r.items()} for b, r in runs.items()},
            "agrees": _holds(fig, runs), "settings": fig.script,
        })  # fmt: skip
    return out
