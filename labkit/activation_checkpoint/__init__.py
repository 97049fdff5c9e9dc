"""Activation checkpointing: keep a block's inputs, recompute the rest in backward.

* ``recompute.py``: the technique, from scratch (a reentrant ``autograd.Function`` that
  replays RNG and autocast state), the policies (full, every k-th block, a chosen set) and
  the wrapper that applies them to a model's blocks in place.
* ``costs.py``: what it costs, measured on one training step: FLOPs (one extra forward of
  each wrapped block), peak activation bytes, seconds.
"""

from labkit.activation_checkpoint.costs import (
    forward_flops,
    policy_costs,
    step_activation_bytes,
    step_flops,
)
from labkit.activation_checkpoint.recompute import (
    CheckpointedBlock,
    Policy,
    apply_activation_checkpointing,
    checkpoint,
    remove_activation_checkpointing,
    select_blocks,
)

__all__ = [
    "CheckpointedBlock",
    "Policy",
    "apply_activation_checkpointing",
    "checkpoint",
    "forward_flops",
    "policy_costs",
    "remove_activation_checkpointing",
    "select_blocks",
    "step_activation_bytes",
    "step_flops",
]
