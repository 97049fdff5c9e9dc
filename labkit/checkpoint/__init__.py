"""Training checkpoints: sharded, atomic, verified on load, reshardable to another world size.

Logical checkpoints (``logical.py``, ``reshard.py``, ``zero_state.py``) hold each tensor once
at its global shape and load under another dp x tp x pp layout; ``async_save.py`` writes
either format in the background; ``dcp.py`` converts to and from torch.distributed.checkpoint.
"""

from labkit.checkpoint.async_save import AsyncCheckpointer, SaveHandle, save_logical
from labkit.checkpoint.logical import LogicalCheckpoint, LogicalState, load_logical
from labkit.checkpoint.reshard import Place, check_split, plan_read, tp_place
from labkit.checkpoint.sharded import (
    Checkpoint,
    CheckpointError,
    latest_step,
    load_checkpoint,
    save_checkpoint,
    shard_range,
)

__all__ = [
    "AsyncCheckpointer",
    "Checkpoint",
    "CheckpointError",
    "LogicalCheckpoint",
    "LogicalState",
    "Place",
    "SaveHandle",
    "check_split",
    "latest_step",
    "load_checkpoint",
    "load_logical",
    "plan_read",
    "save_checkpoint",
    "save_logical",
    "shard_range",
    "tp_place",
]
