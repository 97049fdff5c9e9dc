"""The planner: pure functions that predict memory, step time and MFU of a (dp, tp, pp, ...) layout.

Read in this order:

* ``cluster.py``  what a cluster is (GPUs per node, memory, peak FLOP/s, two link classes).
* ``flops.py``    Megatron's FLOPs-per-iteration formula and Narayanan et al.'s Table 1 as data.
* ``links.py``    which link class (fast inside a node, slow between) each group rides.
* ``stages.py``   the pipeline cut: blocks and FLOPs of every stage and rank (even or uneven).
* ``bubble.py``   the pipeline bubble: the closed form, or the simulator's replay.
* ``plan.py``     enumerate layouts, predict each one's memory per GPU and step time, rank them.
* ``table1.py``   the planner against Megatron's Table 1, row by row.

No processes anywhere: every number is arithmetic a reader can redo by hand.
"""

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
from labkit.planner.table1 import compare_table1

__all__ = [
    "CLUSTERS",
    "MEGATRON_TABLE1",
    "Candidate",
    "Cluster",
    "Prediction",
    "TableRow",
    "achieved_flops_per_gpu",
    "compare_table1",
    "enumerate_candidates",
    "megatron_flops_per_iteration",
    "plan",
    "predict",
    "training_days",
]
