"""Pipeline parallelism: schedules as data, a validator, a simulator, stages and an executor.

Read in this order: ``actions`` (the record), ``schedules`` (GPipe, 1F1B, interleaved 1F1B,
ZB-H1), ``replay`` (a schedule's rules in time), ``validator``, ``simulator``, ``cut`` (how
many blocks each stage holds, even or uneven), ``stages`` (cut a GPT), ``weight_grad`` (the
B/W split), ``executor`` (run on ranks), ``equivalence`` (the proof harness). Imports run one
way: simulator -> validator -> replay.
"""

from labkit.pipeline.actions import Action, Schedule
from labkit.pipeline.schedules import SCHEDULES, make_schedule
from labkit.pipeline.simulator import Costs, SimResult, simulate
from labkit.pipeline.validator import ScheduleError, validate

__all__ = [
    "SCHEDULES",
    "Action",
    "Costs",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "make_schedule",
    "simulate",
    "validate",
]
