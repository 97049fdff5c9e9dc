"""ZeRO from scratch: shard optimizer state (stage 1), gradients (stage 2), parameters (stage 3).

Read in this order: :mod:`~labkit.zero.partition` (the flat layout and units),
:mod:`~labkit.zero.adam` (why Adam shards), :mod:`~labkit.collectives.comm` (the collectives
and their byte count), :mod:`~labkit.zero.sharded` (what every stage shares: the units, the
optimizer state of a shard, the step), then each stage on its own:
:mod:`~labkit.zero.stage0` (the DDP baseline), :mod:`~labkit.zero.stage1`,
:mod:`~labkit.zero.stage2` (with :mod:`~labkit.zero.backward`, reducing during backward),
:mod:`~labkit.zero.stage3`; :mod:`~labkit.zero.factory` builds one by name and
:mod:`~labkit.zero.ledger` measures memory next to :mod:`labkit.memory.model`.
"""

from labkit.collectives.comm import Comm
from labkit.zero.adam import AdamConfig, adamw_
from labkit.zero.factory import STAGE_CLASSES, make_optimizer
from labkit.zero.ledger import measure, measure_gpt
from labkit.zero.partition import FlatLayout, Piece, Unit, flat_layout, make_units
from labkit.zero.sharded import ShardedAdamW
from labkit.zero.stage0 import DDPAdam
from labkit.zero.stage1 import ZeRO1
from labkit.zero.stage2 import ZeRO2
from labkit.zero.stage3 import ZeRO3

__all__ = [
    "STAGE_CLASSES",
    "AdamConfig",
    "Comm",
    "DDPAdam",
    "FlatLayout",
    "Piece",
    "ShardedAdamW",
    "Unit",
    "ZeRO1",
    "ZeRO2",
    "ZeRO3",
    "adamw_",
    "flat_layout",
    "make_optimizer",
    "make_units",
    "measure",
    "measure_gpt",
]
