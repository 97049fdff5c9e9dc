"""What a checkpoint costs the training loop: a synchronous save against an asynchronous one.

A synchronous save stops training for serialise + write + fsync + commit
(:func:`labkit.checkpoint.save_checkpoint`). An asynchronous save
(:class:`labkit.checkpoint.async_save.AsyncCheckpointer`; CheckFreq, Mohan et al. 2021;
``torch.distributed.checkpoint.async_save``) stops it only for the snapshot, a copy of every
tensor off the training path, and writes in a background thread while training goes on.
:func:`save_vs_async` times both on one process, interleaved, medians: the two numbers
Young/Daly's ``delta`` takes, plus the background write the asynchronous save hides.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from labkit.checkpoint import save_checkpoint
from labkit.checkpoint.async_save import AsyncCheckpointer

__all__ = ["save_vs_async"]


def save_vs_async(numel: int, repeats: int = 3, root: str | Path | None = None) -> dict[str, float]:
    """Seconds (medians of ``repeats``, interleaved) that a save of a ZeRO-style state of
    ``numel`` fp32 parameters (params, Adam's m and v: 12 bytes each) stalls the caller:
    ``sync_s`` (all of it), ``async_s`` (the snapshot); ``write_s``, the asynchronous save's
    background write; ``bytes``, the state's size."""
    if numel < 1 or repeats < 1:
        raise ValueError(f"need numel >= 1 and repeats >= 1, got {numel}, {repeats}")
    state = {k: torch.randn(numel) for k in ("params", "exp_avg", "exp_avg_sq")}
    sync, stall, write = [], [], []
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        writer = AsyncCheckpointer(Path(tmp) / "async", keep=1)
        for step in range(1, repeats + 1):
            t0 = time.perf_counter()
            handle = writer.save(step, state)
            stall.append(time.perf_counter() - t0)
            writer.wait()  # not timed: training would run here
            write.append(handle.seconds)
            t0 = time.perf_counter()
            save_checkpoint(Path(tmp) / "sync", step, state, keep=1)
            sync.append(time.perf_counter() - t0)
    return {"sync_s": statistics.median(sync), "async_s": statistics.median(stall),
            "write_s": statistics.median(write), "bytes": float(12 * numel)}  # fmt: skip
