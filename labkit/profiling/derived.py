"""Numbers derived from a step breakdown: utilisation against FLOP efficiency, and cost.

Pitfall P1 made measurable. Two different questions:

* **utilisation** = busy time / step time: is the device doing *anything*? (``nvidia-smi``'s
  "GPU-Util" is the fraction of time any kernel runs; it says nothing about how well.)
* **FLOP efficiency** (MFU when FLOPs are the model's) = achieved FLOP/s / peak FLOP/s:
  of what the hardware could compute, how much did it? FLOPs are counted by PyTorch's
  ``FlopCounterMode`` (matmuls and convolutions, forward and backward), not estimated by hand.

A run can be 100% utilised at a few % efficiency: small matrices, memory-bound kernels,
launch overhead. Reading utilisation alone hides that.

Cost (K12), stated, never implied:

* samples/s = global batch / step time;
* GPU-hours per million samples = devices * 1e6 / (samples/s) / 3600, and its price at a
  stated $ per GPU-hour;
* time-to-accuracy: wall time until validation accuracy first reaches a target (what a
  team pays for; TFLOP/s alone is not it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch.utils.flop_counter import FlopCounterMode

__all__ = [
    "DATASHEET_PEAK_FLOPS",
    "count_step_flops",
    "matmul_peak_flops",
    "flop_efficiency",
    "samples_per_second",
    "gpu_hours_per_million",
    "cost_per_million",
    "time_to_accuracy",
]

# Dense peak FLOP/s from vendor datasheets (no sparsity): stated numbers, not measured here.
DATASHEET_PEAK_FLOPS = {
    "H100 SXM bf16": 989e12,
    "A100 bf16": 312e12,
    "V100 fp16": 125e12,
    "A100 fp32 (no TF32)": 19.5e12,
}


def count_step_flops(step: Callable[[], object]) -> int:
    """FLOPs one call of ``step`` (forward + backward, say) performs, by ``FlopCounterMode``."""
    with FlopCounterMode(display=False) as counter:
        step()
    return int(counter.get_total_flops())


def matmul_peak_flops(n: int = 1024, repeats: int = 5, device: str | torch.device = "cpu") -> float:
    """A practical peak of this device: the best FLOP/s of an ``n x n`` fp32 matmul.

    Datasheet peaks are for tensor cores in 16-bit; on a CPU the achievable matmul rate is the
    honest denominator. ``2 n^3`` FLOPs per matmul (a multiply and an add per term).
    """
    if n < 1 or repeats < 1:
        raise ValueError(f"need n >= 1 and repeats >= 1, got n={n}, repeats={repeats}")
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    a @ b  # warm-up
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def flop_efficiency(flops: float, seconds: float, peak_flops: float) -> float:
    """Achieved FLOP/s over peak: ``flops / seconds / peak_flops``."""
    if seconds <= 0 or peak_flops <= 0:
        raise ValueError(f"need seconds > 0 and peak_flops > 0, got {seconds}, {peak_flops}")
    return flops / seconds / peak_flops


def samples_per_second(global_batch: int, step_seconds: float) -> float:
    if step_seconds <= 0 or global_batch < 1:
        raise ValueError(
            f"need step_seconds > 0 and global_batch >= 1, got {step_seconds}, {global_batch}"
        )
    return global_batch / step_seconds


def gpu_hours_per_million(samples_per_s: float, devices: int) -> float:
    """Device-hours to process one million samples: ``devices * 1e6 / samples_per_s / 3600``."""
    if samples_per_s <= 0 or devices < 1:
        raise ValueError(f"need samples_per_s > 0 and devices >= 1, got {samples_per_s}, {devices}")
    return devices * 1e6 / samples_per_s / 3600


def cost_per_million(samples_per_s: float, devices: int, price_per_gpu_hour: float) -> float:
    """Dollars per million samples at a stated price per device-hour."""
    if price_per_gpu_hour < 0:
        raise ValueError(f"price_per_gpu_hour must be >= 0, got {price_per_gpu_hour}")
    return gpu_hours_per_million(samples_per_s, devices) * price_per_gpu_hour


def time_to_accuracy(history: Sequence[tuple[float, float]], target: float) -> float | None:
    """First wall time at which accuracy reached ``target``; ``history`` holds (seconds,
    accuracy) in time order. None when the target was never reached."""
    for seconds, accuracy in history:
        if accuracy >= target:
            return seconds
    return None
