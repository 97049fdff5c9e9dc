"""ZeRO from scratch: shard optimizer state (stage 1), gradients (stage 2), parameters (stage 3).

Read in this order: :mod:`~labkit.zero.partition` (the pure flat layout), :mod:`~labkit.zero.adam`
(why Adam shards), :mod:`~labkit.collectives.comm` (the collectives and their byte count),
:mod:`~labkit.zero.stage1`, :mod:`~labkit.zero.stage2`, :mod:`~labkit.zero.stage3`, then
:mod:`~labkit.zero.ledger` (measured memory next to :mod:`labkit.memory.model`).
"""

from labkit.collectives.comm import Comm
from labkit.zero.adam import AdamConfig, adamw_
from labkit.zero.ledger import STAGE_CLASSES, make_optimizer, measure, measure_gpt
from labkit.zero.partition import FlatLayout, Piece, flat_layout
from labkit.zero.stage1 import DDPAdam, ZeRO1
from labkit.zero.stage2 import ZeRO2
from labkit.zero.stage3 import ZeRO3

__all__ = [
    "STAGE_CLASSES",
    "AdamConfig",
    "Comm",
    "DDPAdam",
    "FlatLayout",
    "Piece",
    "ZeRO1",
    "ZeRO2",
    "ZeRO3",
    "adamw_",
    "flat_layout",
    "make_optimizer",
    "measure",
    "measure_gpt",
]
