"""Checks for exercise 08 (plan a large GPT on a cluster): pure arithmetic, no processes.

Part 1, :func:`check_layout`: the learner picks (dp, tp, pp, micro-batch, ZeRO stage,
recompute) for :data:`SCENARIO`'s model, cluster and global batch. The check says whether it
is a valid layout (naming the numbers that do not divide), whether it fits in memory (and by
how many GB, and which part, it misses), and compares its predicted throughput with the
planner's best over the same space; it passes when the layout fits and reaches
``min_ratio`` of the best.

Part 2, :func:`check_memory`: the learner's memory estimate per GPU of one given layout,
worked by hand (model states of the stage's shard, Korthikanti's activations times the
micro-batches in flight, the largest transient plus 1 GB), part by part within 1% of the planner's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from labkit.checks.core import CheckFailed, passed
from labkit.models.gpt import GPTConfig
from labkit.planner import CLUSTERS, Candidate, Cluster, Prediction, predict
from labkit.viz.planner import format_plan, gpt_of_size, plan_3d

__all__ = ["HAND_LAYOUT", "SCENARIO", "Scenario", "check_layout", "check_memory"]

PARTS = ("parameters", "gradients", "optimizer", "activations", "workspace")


@dataclass(frozen=True)
class Scenario:
    model: GPTConfig
    cluster: Cluster
    global_batch: int


# a 39B GPT (Megatron's Table 1 shape) on 4 DGX A100 80GB nodes, 1M-token batches
SCENARIO = Scenario(gpt_of_size(39), CLUSTERS["dgx-a100-80gb"].with_nodes(4), 512)
# the layout whose memory part 2 asks for by hand
HAND_LAYOUT = Candidate(dp=2, tp=8, pp=2, micro_batch=1, zero=1, recompute="full")


def _predict(cand: Candidate, sc: Scenario) -> Prediction:
    try:
        return predict(sc.model, sc.cluster, sc.global_batch, cand)
    except ValueError as e:
        raise CheckFailed(f"not a valid layout for this model and cluster: {e}") from None


def check_layout(
    choice: dict[str, Any], scenario: Scenario = SCENARIO, min_ratio: float = 0.8
) -> Prediction:
    """``choice``: dict with dp, tp, pp, micro_batch, zero (0-3), recompute ("none",
    "selective", "full"). Raises :class:`CheckFailed` with the reason; returns the prediction."""
    keys = {"dp", "tp", "pp", "micro_batch", "zero", "recompute"}
    if not isinstance(choice, dict) or set(choice) != keys:
        got = sorted(choice) if isinstance(choice, dict) else type(choice).__name__
        raise CheckFailed(f"expected a dict with keys {sorted(keys)}, got {got}")
    try:
        cand = Candidate(**choice)
        cand.degrees  # noqa: B018 - validates the degrees
    except (TypeError, ValueError) as e:
        raise CheckFailed(f"not a valid layout: {e}") from None
    pred = _predict(cand, scenario)
    cap = scenario.cluster.memory_bytes
    if not pred.fits:
        over = pred.memory_total - cap
        biggest = max(PARTS, key=lambda k: pred.memory[k])
        parts = ", ".join(f"{k} {pred.memory[k] / 1e9:.1f}" for k in PARTS)
        raise CheckFailed(
            f"does not fit: {pred.memory_total / 1e9:.1f} GB per GPU of {cap / 1e9:.0f} GB, over "
            f"by {over / 1e9:.1f} GB ({parts} GB; the largest part is {biggest})"
        )
    best = plan_3d(scenario.model, scenario.cluster, scenario.global_batch)[0]
    ratio = pred.tokens_per_second / best.tokens_per_second
    summary = (
        f"{pred.tokens_per_second:,.0f} tokens/s predicted (MFU {pred.mfu:.2f}) against the "
        f"planner's best {best.tokens_per_second:,.0f} ({ratio:.0%}): {best.candidate}"
    )
    if ratio < min_ratio:
        raise CheckFailed(f"fits ({pred.memory_total / 1e9:.1f} GB) but slow: {summary}; "
                          f"where your time goes: " + ", ".join(
                              f"{k} {v:.1f} s" for k, v in pred.time.items()))  # fmt: skip
    passed(f"fits in {pred.memory_total / 1e9:.1f} of {cap / 1e9:.0f} GB; {summary}")
    return pred


def check_memory(
    estimate: dict[str, float], cand: Candidate = HAND_LAYOUT, scenario: Scenario = SCENARIO
) -> None:
    """``estimate``: bytes per GPU by part (parameters, gradients, optimizer, activations,
    workspace) of ``cand``, each within 1% of the planner's; the first part off is named."""
    if not isinstance(estimate, dict) or set(estimate) != set(PARTS):
        keys = sorted(estimate) if isinstance(estimate, dict) else type(estimate).__name__
        raise CheckFailed(f"expected a dict with keys {list(PARTS)}, got {keys}")
    want = _predict(cand, scenario).memory
    for part in PARTS:
        mine, exp = float(estimate[part]), want[part]
        if abs(mine - exp) > 0.01 * exp:
            raise CheckFailed(
                f"{part}: you estimate {mine / 1e9:.3f} GB, the planner {exp / 1e9:.3f} GB "
                f"({(mine - exp) / exp:+.1%}); the other parts are not checked yet"
            )
    total = sum(want.values())
    passed(f"every part within 1%: {total / 1e9:.2f} GB per GPU for {cand}")


def show_plan(scenario: Scenario = SCENARIO, top: int = 8) -> str:
    """The planner's table for the scenario (to read AFTER answering)."""
    return format_plan(plan_3d(scenario.model, scenario.cluster, scenario.global_batch), top,
                       memory_gb=scenario.cluster.memory_bytes / 1e9)  # fmt: skip
