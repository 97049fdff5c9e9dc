"""Expert parallelism's all-to-all against its peers, and the cost of load imbalance.

On ``--ranks`` gloo ranks (the ep group), one MoE layer's forward, interleaved round by round
with warm-up, medians reported:

* the expert-parallel layer with labkit's all-to-all (one batch of point-to-point messages);
* the same with torch's ``all_to_all_single`` (split sizes);
* the all-gather dispatch (every token and gate to every rank, a reduce-scatter back);
* the dense MoE on one process (every token through every expert).

Then forward+backward of the EP layer at increasing routing skew (a fraction of the tokens
forced onto rank 0's experts), with the rank-level load imbalance, and the bytes sent against
the uniform-routing formula. Ratios are printed against the labkit all-to-all. On a shared
2-core CPU every number is rough; ``--steps`` more for steadier medians.

    .venv/bin/python benchmarks/bench_experts.py
    .venv/bin/python benchmarks/bench_experts.py --ranks 4 --tokens 4096 --top-k 1
"""

from __future__ import annotations

import argparse
from typing import Any

from labkit import launch
from labkit.experts.costs import all_to_all_bytes
from labkit.viz.table import Column, format_table


def _on_rank(args: argparse.Namespace) -> dict[str, Any]:
    from labkit.measure.experts import dispatch_race, skewed_steps

    race = dispatch_race(args.tokens, args.d, args.d_ff, args.experts, args.top_k, args.steps)
    skews = skewed_steps((0.0, 0.5, 1.0), args.tokens // 2, args.d, 4 * args.d_ff, steps=args.steps)
    return {"race": race, "skews": skews}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--d-ff", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if args.experts % args.ranks:
        parser.error(f"--experts {args.experts} must be divisible by --ranks {args.ranks}")
    results = launch(_on_rank, args, world_size=args.ranks, timeout=600, quiet=True)
    race = results[0]["race"]  # rank 0's medians (every rank waits at the same barriers)
    base = race["ms"]["all-to-all (labkit)"]
    rows = [(name, ms, ms / base) for name, ms in race["ms"].items()]
    print(format_table(
        [Column("forward of one MoE layer"), Column("median", "ms", ".2f"),
         Column("/ labkit all-to-all", "x", ".2f")],
        rows, title=f"{args.ranks} ranks, {args.tokens} tokens/rank, d={args.d}, "
        f"E={args.experts}, k={args.top_k}",
    ))  # fmt: skip
    b = race["bytes"]
    formula = 2 * all_to_all_bytes(args.tokens, args.d, args.top_k, args.ranks, itemsize=4)
    print(
        f"\nbytes sent per rank per forward: all-to-all {b['all-to-all'] / 1e6:.3f} MB "
        f"(formula 2 k n (ep-1)/ep d 4 = {formula / 1e6:.3f} MB), all-gather dispatch "
        f"{b['all-gather dispatch'] / 1e6:.3f} MB: "
        f"{b['all-gather dispatch'] / b['all-to-all']:.2f}x "
        f"(ep / k = {args.ranks / args.top_k:.1f})"
    )
    skew_rows = [
        (r["skew"], max(res["skews"][i]["rank imbalance"] for res in results),
         max(res["skews"][i]["step ms"] for res in results), r["a2a bytes"], r["formula bytes"])
        for i, r in enumerate(results[0]["skews"])
    ]  # fmt: skip
    base_ms = skew_rows[0][2]
    print()
    print(format_table(
        [Column("tokens forced to rank 0", "", ".0%"), Column("rank imbalance", "max/mean", ".2f"),
         Column("fwd+bwd, slowest rank", "ms", ".1f"), Column("a2a sent", "MB", ".3f", 1e-6),
         Column("formula", "MB", ".3f", 1e-6)],
        skew_rows, title="load imbalance against step time (top-1, dropless)",
    ))  # fmt: skip
    print(f"step time at full skew / balanced: {skew_rows[-1][2] / base_ms:.2f}x")


if __name__ == "__main__":
    main()
