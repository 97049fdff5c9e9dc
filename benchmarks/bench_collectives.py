"""busbw of labkit's ring collectives against torch.distributed's, per size and op.

    .venv/bin/python benchmarks/bench_collectives.py            # 2 ranks, 4 KB .. 256 MB
    .venv/bin/python benchmarks/bench_collectives.py --four     # 2 ranks, then 4 ranks
    .venv/bin/python benchmarks/bench_collectives.py --min-mb 16 --repeats 9

Method (labkit/collectives/bench.py): float32, ours and torch's interleaved in one run, a barrier
before each timed repeat, the slowest rank's time, the median over repeats. busbw as nccl-tests
defines it. Each line also gives ours as a fraction of a single-thread memcpy's bandwidth
(bytes copied per second in this process), the ceiling of any CPU collective here.

Targets on the 2-core CI machine, gloo, 2 ranks: ring all-reduce busbw >= 1.0x torch's from
16 MB up; ring reduce-scatter and all-gather >= 1.5x torch's (from 16 MB up).
"""

from __future__ import annotations

import argparse

from labkit.collectives.bench import (
    DEFAULT_SIZES,
    format_table,
    memcpy_bandwidth,
    ratios,
    run_bench,
)

TARGETS = {"all_reduce": 1.0, "reduce_scatter": 1.5, "all_gather": 1.5}
TARGET_FROM = 16 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--four", action="store_true", help="also run on 4 ranks")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--min-mb", type=float, default=0, help="skip sizes below this many MB")
    args = parser.parse_args()

    memcpy = memcpy_bandwidth()
    print(f"single-thread memcpy: {memcpy / 1e9:.2f} GB/s")
    sizes = [s for s in DEFAULT_SIZES if s >= args.min_mb * 2**20]
    for world_size in (2, 4) if args.four else (2,):
        records = run_bench(world_size, sizes, repeats=args.repeats, warmup=1)
        print(f"\n== {world_size} ranks, gloo, float32 (busbw in GB/s) ==")
        print(format_table(records, memcpy))
        if world_size != 2:
            continue
        print("\ntargets (2 ranks, sizes >= 16 MB):")
        for op, target in TARGETS.items():
            got = {n: r for (o, n), r in ratios(records).items() if o == op and n >= TARGET_FROM}
            if got:
                worst = min(got.values())
                verdict = "met" if worst >= target else "MISSED"
                print(f"  {op:<15} ours/torch >= {target:.1f}x: {verdict} (lowest {worst:.2f}x, at {min(got, key=got.__getitem__) >> 20} MB)")


if __name__ == "__main__":
    main()
