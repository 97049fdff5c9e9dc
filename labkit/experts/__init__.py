"""Mixture of experts and expert parallelism, from scratch (lesson ``notebooks/16_experts``).

Read in this order:

* ``router.py``   top-k softmax routing, capacity and drops, the balancing and z losses.
* ``layer.py``    the MoE feed-forward layer on one process (the reference), a shared expert.
* ``parallel.py`` experts sharded over an ``ep`` group, tokens dispatched and combined by
                  all-to-all (``labkit.collectives.all_to_all`` or torch's, one switch).
* ``groups.py``   the ep / expert-dp / dp / tp groups, and which group reduces which gradient.
* ``costs.py``    pure formulas: parameters against FLOPs per token, all-to-all bytes and time,
                  capacity padding, expert memory per rank (the planner calls these).
* ``peers.py``    the same MoE computed densely, and an all-gather dispatch (the peers).
* ``model.py``    a GPT whose feed-forward layers are MoE layers (``labkit.models.moe``).
"""

from labkit.experts.groups import (
    ExpertGroups,
    build_expert_groups,
    expert_rank_groups,
    reduce_moe_gradients,
)
from labkit.experts.layer import Experts, MoELayer
from labkit.experts.parallel import ExpertParallelMoE
from labkit.experts.router import TopKRouter, capacity, load_balancing_loss, route, router_z_loss

__all__ = [
    "ExpertGroups",
    "ExpertParallelMoE",
    "Experts",
    "MoELayer",
    "TopKRouter",
    "build_expert_groups",
    "capacity",
    "expert_rank_groups",
    "load_balancing_loss",
    "reduce_moe_gradients",
    "route",
    "router_z_loss",
]
