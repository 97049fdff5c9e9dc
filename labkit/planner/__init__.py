"""The planner: pure functions that predict memory, step time and MFU of a (dp, tp, pp, ...) layout.

Read in this order:

* ``cluster.py``  what a cluster is (GPUs per node, memory, peak FLOP/s, two link classes).
* ``flops.py``    Megatron's FLOPs-per-iteration formula and Narayanan et al.'s Table 1 as data.
* ``links.py``    which link class (fast inside a node, slow between) each group rides.
* ``stages.py``   the pipeline cut: blocks and FLOPs of every stage and rank (even or uneven).
* ``bubble.py``   the pipeline bubble: the closed form, or the simulator's replay.
* ``space.py``    the search space: a candidate (ZeRO 0-3, HSDP, SP, recompute, offload, ...),
                  its prediction (fits, risky), their enumeration, the bytes each puts on the wire.
* ``memory.py``   memory per GPU: ``labkit.memory.estimate``'s model with a candidate's inputs.
* ``roofline.py`` a GEMM's time from its shape on the card's roofline (``data/chips.json``:
                  peak, HBM, the efficiency curve's constants, each with its source).
* ``timing.py``   one layer's GEMMs, attention (explicit or flash), elementwise traffic and
                  recompute per policy; the head; the optimizer step.
* ``cp_ep.py``    context and expert parallelism's time: ring K/V beyond what attention hides,
                  the all-to-alls on the ep group's link, MoE GEMMs at top-k, MoE model FLOPs.
* ``steptime.py`` one iteration's named terms: compute, bubble, tp / pp / dp / cp / ep
                  communication (overlap, bytes as the recipe keeps them), optimizer.
* ``single_constant.py``  the old one-efficiency time model, kept as the negative control.
* ``plan.py``     predict each candidate's memory per GPU and step time, rank them.
* ``budget.py``   the whole run: tokens, 6ND FLOPs, days, GPU-hours, cost, failures and checkpoints.
* ``table1.py``   the planner against Megatron's Table 1, row by row (run it:
                  ``python -m labkit.planner.table1``; not imported here, so that runs clean).
* ``published.py`` Korthikanti's Table 5 and other published runs as data, sources beside.
* ``sc21.py``     Table 1's runs at their own settings (run_table_1.sh) as Megatron 2021 ran them.
* ``figures.py``  Figures 12-16 of the same paper: the planner's order against the measured one.
* ``zero3.py``    ZeRO-3 / FSDP's per-block schedule (rings, prefetch, latency), ``predict``'s
                  dp term for ZeRO-3 with overlap; ``zero3_runs.py`` the published runs.
* ``accuracy.py`` the errors at the configurations really measured (``python -m labkit.planner``).
* ``gpu_checks.py`` this project's H200 measurement against the planner's prediction.
* ``long_moe.py`` Mixtral 8x7B's shapes and a 128k-context dense model, printed
                  (``python -m labkit.planner``, last section).

No processes anywhere: every number is arithmetic a reader can redo by hand.
"""

from labkit.planner.budget import RunBudget, chinchilla_tokens, run_budget, young_daly_interval
from labkit.planner.cluster import CLUSTERS, Cluster
from labkit.planner.flops import (
    MEGATRON_TABLE1,
    TableRow,
    achieved_flops_per_gpu,
    megatron_flops_per_iteration,
    training_days,
)
from labkit.planner.plan import (
    Candidate,
    Prediction,
    enumerate_candidates,
    plan,
    predict,
)

__all__ = [
    "CLUSTERS",
    "MEGATRON_TABLE1",
    "Candidate",
    "Cluster",
    "Prediction",
    "RunBudget",
    "TableRow",
    "achieved_flops_per_gpu",
    "chinchilla_tokens",
    "enumerate_candidates",
    "megatron_flops_per_iteration",
    "plan",
    "predict",
    "run_budget",
    "training_days",
    "young_daly_interval",
]
