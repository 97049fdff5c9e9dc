"""labkit's collectives against torch.distributed's (gloo), every size from 4 KB to 256 MB.

    .venv/bin/python benchmarks/bench_collectives.py              # 2 ranks, 4 KB .. 256 MB
    .venv/bin/python benchmarks/bench_collectives.py --four       # then 4 ranks too
    .venv/bin/python benchmarks/bench_collectives.py --algorithms # each all-reduce algorithm alone
    .venv/bin/python benchmarks/bench_collectives.py --min-mb 16 --repeats 9

Method (labkit/measure/collectives.py): float32; ours and torch's interleaved round by round,
alternating which runs first; a barrier before each call; warm-up rounds dropped; the slowest
rank's time; the median over rounds. busbw as nccl-tests defines it. "ours" is labkit's
all-reduce (``collectives.auto``: recursive doubling up to ``auto.SMALL_BYTES``, the tuned
ring above) and the tuned ring reduce-scatter and all-gather.

Target (2 ranks): ours/torch >= 1.0x at every size for all-reduce, and >= 1.5x from 16 MB up for
reduce-scatter and all-gather. On a shared machine the small sizes are scheduling noise: rerun
when the machine is quiet before believing a miss or a win.
"""

from __future__ import annotations

import argparse

from labkit.collectives.auto import SMALL_BYTES
from labkit.measure.collectives import (
    DEFAULT_SIZES,
    format_table,
    human_bytes,
    memcpy_bandwidth,
    ratios,
    run_bench,
)

TARGETS = {"all_reduce": (1.0, 0), "reduce_scatter": (1.5, 16 << 20), "all_gather": (1.5, 16 << 20)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--four", action="store_true", help="also run on 4 ranks")
    parser.add_argument("--algorithms", action="store_true", help="time each all-reduce algorithm")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--min-mb", type=float, default=0, help="skip sizes below this many MB")
    parser.add_argument("--max-mb", type=float, default=256, help="skip sizes above this many MB")
    args = parser.parse_args()

    memcpy = memcpy_bandwidth()
    print(
        f"single-thread memcpy: {memcpy / 1e9:.2f} GB/s; "
        f"labkit's all-reduce uses recursive doubling up to {human_bytes(SMALL_BYTES)}"
    )
    sizes = [s for s in DEFAULT_SIZES if args.min_mb * 2**20 <= s <= args.max_mb * 2**20]
    for world_size in (2, 4) if args.four else (2,):
        records = run_bench(
            world_size, sizes, repeats=args.repeats, warmup=args.warmup, algorithms=args.algorithms
        )
        print(
            f"\n== {world_size} ranks, gloo, float32: median times; ours/torch = torch time / "
            "ours =="
        )
        print(format_table(records, memcpy=memcpy))
        if args.algorithms:
            print("\nall-reduce, each algorithm alone: torch time / its time")
            impls = [
                i for i in dict.fromkeys(r.impl for r in records) if i not in ("ours", "torch")
            ]
            print(f"{'size':>8}" + "".join(f"{i:>20}" for i in impls))
            per = {i: ratios(records, i) for i in impls}
            for n in sizes:
                cells = [per[i].get(("all_reduce", n)) for i in impls]
                print(f"{human_bytes(n):>8}" + "".join(f"{c:>19.2f}x" for c in cells if c))
        if world_size != 2:
            continue
        print("\ntargets (2 ranks):")
        for op, (target, start) in TARGETS.items():
            got = {n: r for (o, n), r in ratios(records).items() if o == op and n >= start}
            if got:
                worst = min(got, key=got.__getitem__)
                verdict = "met" if got[worst] >= target else "MISSED"
                print(
                    f"  {op:<15} ours/torch >= {target:.1f}x from "
                    f"{human_bytes(max(start, sizes[0]))}:"
                    f" {verdict} (lowest {got[worst]:.2f}x, at {human_bytes(worst)})"
                )


if __name__ == "__main__":
    main()
