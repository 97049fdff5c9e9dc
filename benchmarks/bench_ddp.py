"""Step time of labkit's DDP variants against torch's DistributedDataParallel, 2 ranks.

    .venv/bin/python benchmarks/bench_ddp.py [--steps 30] [--bucket-mb 4]

Two workloads (see labkit/ddp/timing.py): a compute-bound CNN and a communication-bound MLP
(5.8 M parameters). Each step = forward + backward + gradient sync + SGD step, median over
steps the slower rank's time. Target: overlapped <= 1.0x torch DDP on both (issue 26; it was 1.05x).
"""

from __future__ import annotations

import argparse

from labkit.launch import launch


def _job(bucket_mb: float, steps: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labkit.ddp import VARIANTS
    from labkit.ddp.timing import compare_step_times

    wraps = {
        "torch DDP": lambda m: DDP(m, bucket_cap_mb=bucket_mb),
        "naive": lambda m: VARIANTS["naive"](m),
        "flat": lambda m: VARIANTS["flat"](m),
        "bucketed": lambda m: VARIANTS["bucketed"](m, bucket_cap_mb=bucket_mb),
        "overlapped": lambda m: VARIANTS["overlapped"](m, bucket_cap_mb=bucket_mb),
    }
    return compare_step_times(wraps, steps=steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=30, help="timed steps per variant (interleaved)"
    )
    parser.add_argument("--bucket-mb", type=float, default=4.0, help="bucket cap, ours and torch's")
    args = parser.parse_args()
    times = launch(_job, args.bucket_mb, args.steps, world_size=2, quiet=True, timeout=600)[0]
    print(f"2 ranks, bucket cap {args.bucket_mb} MB (ours and torch's), median ms/step")
    print(f"{'workload':10s}{'variant':12s}{'ms/step':>10s}{'ours/torch':>12s}")
    for workload in ("cnn", "mlp"):
        ref = times[(workload, "torch DDP")]
        for (w, name), t in times.items():
            if w == workload:
                print(f"{workload:10s}{name:12s}{t * 1e3:10.1f}{t / ref:12.2f}x")
    for workload in ("cnn", "mlp"):
        ratio = times[(workload, "overlapped")] / times[(workload, "torch DDP")]
        verdict = "meets" if ratio <= 1.0 else "MISSES"
        print(f"overlapped/torch DDP on {workload}: {ratio:.3f}x ({verdict} the 1.0x target)")


if __name__ == "__main__":
    main()
