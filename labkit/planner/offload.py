"""What CPU offload moves per step and GPU (ZeRO-Offload, Ren et al. 2021): the bytes over the
host link and the parameters the CPU optimizer steps. A pure function of a candidate, beside
the dp collectives of :func:`labkit.planner.space.wire_bytes`; the time side
(``steptime.py``) prices it as the ``offload`` term."""

from __future__ import annotations

from labkit.memory.model import Precision
from labkit.planner.space import Candidate

__all__ = ["offload_traffic"]


def offload_traffic(cand: Candidate, psi: float, precision: Precision, shard: int) -> dict:
    """What CPU offload adds per step and GPU: ``pcie_bytes`` (gradients down in their own
    dtype, updated 16-bit parameters back up) and ``cpu_step_params`` (the parameters the CPU
    optimizer steps: this GPU's ZeRO shard). Zero for ``offload="none"``. The time side's
    term is ``offload``: ``pcie_bytes`` over the host link plus the CPU Adam step (memory
    bound: about 16 bytes read and written per parameter), less what overlaps backward."""
    if cand.offload == "none":
        return {"pcie_bytes": 0.0, "cpu_step_params": 0.0}
    own = psi / shard if cand.zero >= 1 else psi
    return {
        "pcie_bytes": own * (precision.grad_bytes + precision.param_bytes),
        "cpu_step_params": own,
    }
