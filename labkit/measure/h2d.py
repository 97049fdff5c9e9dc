"""Host-to-device latency of one batch, as percentiles (K8: telemetry beyond the mean).

A step's input copy is small beside its compute, but its *tail* stalls every rank of a
synchronous job: the p99 matters, not the mean. On a CUDA device this times
``batch.to(device, non_blocking=True)`` followed by a synchronize, from pageable host memory
against page-locked (pinned) memory: a pinned buffer is copied by DMA straight away, a
pageable one is first staged through a pinned bounce buffer by the driver.

Without an accelerator there is no device and no pinned allocator (``pin_memory=True``
raises on a CPU-only torch). The same measurement then times the host-side half of the
copy, and says so in ``kind``: copying the batch into a buffer allocated once (what a pinned
staging buffer is) against into a freshly allocated tensor each time (the pageable path, which
also pays first-touch page faults: about 57 ms per 128 MB on this machine, field notes).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Latency", "h2d_latency", "percentile", "recorded_gpu_h2d"]


def percentile(samples: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation between closest ranks."""
    if not samples or not 0 <= q <= 100:
        raise ValueError(f"need samples and 0 <= q <= 100, got {len(samples)} samples, q={q}")
    xs = sorted(samples)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Latency:
    """Seconds per copy of one batch: median, p90, p99 and max over ``n`` copies."""

    kind: str  # what was timed, in words
    nbytes: int
    p50: float
    p90: float
    p99: float
    max: float
    n: int

    @property
    def gbps(self) -> float:
        """Bytes per second at the median."""
        return self.nbytes / self.p50


def _summary(kind: str, nbytes: int, times: list[float]) -> Latency:
    return Latency(kind, nbytes, percentile(times, 50), percentile(times, 90),
                   percentile(times, 99), max(times), len(times))  # fmt: skip


def h2d_latency(
    shape: tuple[int, ...] = (64, 3, 224, 224),
    *,
    repeats: int = 50,
    warmup: int = 3,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.uint8,
) -> dict[str, Latency]:
    """``{"pageable": ..., "pinned": ...}`` for one batch of ``shape`` (default: 64 uint8
    224x224 RGB images, as a decoder hands them over), interleaved copy by copy so that load
    on a shared machine hits both alike. ``device`` defaults to CUDA when available."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    dev = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))  # fmt: skip
    src = torch.randint(0, 255, shape, dtype=torch.uint8).to(dtype)
    nbytes = src.numel() * src.element_size()
    times: dict[str, list[float]] = {"pageable": [], "pinned": []}
    if dev.type == "cuda":
        pinned = src.pin_memory()

        def copy(name: str) -> None:
            (pinned if name == "pinned" else src).to(dev, non_blocking=True)
            torch.cuda.synchronize(dev)

        kinds = {"pageable": f"pageable host -> {dev}", "pinned": f"pinned host -> {dev}"}
    else:
        staging = torch.empty_like(src)  # allocated and touched once, like a pinned buffer
        staging.copy_(src)

        def copy(name: str) -> None:
            if name == "pinned":
                staging.copy_(src)
            else:
                torch.empty_like(src).copy_(src)  # fresh pages every time

        kinds = {
            "pageable": "CPU only: copy into a freshly allocated tensor (no device here)",
            "pinned": "CPU only: copy into a preallocated buffer (no pinned memory here)",
        }
    for i in range(warmup + repeats):
        for name in times:
            t0 = time.perf_counter()
            copy(name)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: _summary(kinds[name], nbytes, ts) for name, ts in times.items()}


def recorded_gpu_h2d(docs: Path | None = None) -> dict[str, dict] | None:
    """The newest GPU run of this measurement on record: ``docs/gpu_h2d_<card>.json``, written
    by ``benchmarks/gpu_check.py j`` on a lent GPU (``{"device", "shape", "pageable",
    "pinned"}``, each copy a :class:`Latency` as a dict), or None when no GPU has run it. JSON
    only: nothing is unpickled."""
    docs = docs or Path(__file__).resolve().parents[2] / "docs"
    runs = sorted(docs.glob("gpu_h2d_*.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(runs[-1].read_text()) if runs else None
