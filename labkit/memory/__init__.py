"""Memory: a measured ledger (live-tensor tracker) and the analytic ZeRO memory model."""

from labkit.memory.tracker import (
    CATEGORIES,
    CudaMemoryTracker,
    MemoryLedger,
    MemoryTracker,
    tracker_for,
)

__all__ = ["CATEGORIES", "CudaMemoryTracker", "MemoryLedger", "MemoryTracker", "tracker_for"]
