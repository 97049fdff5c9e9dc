"""Training checkpoints: sharded, atomic, verified on load, reshardable to another world size."""

from labkit.checkpoint.sharded import (
    Checkpoint,
    CheckpointError,
    latest_step,
    load_checkpoint,
    save_checkpoint,
    shard_range,
)

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "latest_step",
    "load_checkpoint",
    "save_checkpoint",
    "shard_range",
]
