"""ZeRO, ours vs PyTorch's, in one run on 2 ranks (gloo on CPU, or NCCL on 2 GPUs).

    ours ZeRO-1 / ZeroRedundancyOptimizer   target <= 1.0x
    ours ZeRO-3 / FSDP2 fully_shard          target <= 1.1x
    peak bytes per rank of each (the live-tensor tracker, which also follows FSDP's resize_)

Every contender trains the same GPT from the same seed on the same batches; the script
fails if their losses disagree (the numerical cross-check). The contenders step interleaved,
round by round, so load from elsewhere hits them alike; ms/step is the median over
``--steps`` rounds after ``--warmup`` (min and max shown). torch's AdamW runs with
``foreach=True``. On a shared 2-core machine expect +-20% run to run.

Usage: .venv/bin/python benchmarks/bench_zero.py [--steps 20] [--layers 4] [--embd 256]
"""

from __future__ import annotations

import argparse

from labkit.launch import launch
from labkit.models import GPTConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    if args.steps < 20 or min(args.layers, args.embd, args.batch) < 1 or args.warmup < 1:
        raise SystemExit(f"need steps >= 20, warmup >= 1, positive sizes, got {vars(args)}")
    if args.embd % 4:
        raise SystemExit(f"embd must be divisible by the 4 heads, got {args.embd}")
    gpt = GPTConfig(n_layer=args.layers, n_embd=args.embd, n_head=4, block_size=128)

    def job() -> dict:
        from labkit.zero.compare import run_side_by_side

        return run_side_by_side(gpt=gpt, batch=args.batch, steps=args.steps, warmup=args.warmup)

    per_rank = launch(job, world_size=2, timeout=900, quiet=True)
    print(
        f"GPT {args.layers} x {args.embd} ({gpt.num_params() / 1e6:.2f}M params), "
        f"batch {args.batch} x 128 per rank, 2 ranks, {args.steps} interleaved steps"
    )
    head = ("contender", "ms/step median", "min", "max", "peak MiB r0", "peak MiB r1")
    print(f"{head[0]:>30} | " + " | ".join(f"{h:>14}" for h in head[1:]))
    for name, r in per_rank[0].items():
        s = r["spread"]
        peaks = [pr[name]["peak_bytes"] / 2**20 for pr in per_rank]
        cells = [1e3 * s.median, 1e3 * s.min, 1e3 * s.max, *peaks]
        print(f"{name:>30} | " + " | ".join(f"{c:>14.2f}" for c in cells))
    res = per_rank[0]
    ref = res["torch ZeroRedundancyOptimizer"]["losses"]
    for name, r in res.items():
        bad = [(a, b) for a, b in zip(r["losses"], ref) if abs(a - b) > 1e-4 * abs(b)]
        if bad:
            raise SystemExit(f"{name}: losses differ from ZeroRedundancyOptimizer's: {bad}")
    print("losses: all contenders agree step by step")

    def ratio(a: str, b: str, target: float) -> None:
        x = res[a]["ms_per_step"] / res[b]["ms_per_step"]
        peak = res[a]["peak_bytes"] / res[b]["peak_bytes"]
        verdict = "OK" if x <= target else "MISS"
        print(f"{a} / {b}: time {x:.2f}x (target <= {target}x) {verdict}; peak bytes {peak:.2f}x")

    ratio("ours zero1", "torch ZeroRedundancyOptimizer", 1.0)
    ratio("ours zero3", "torch FSDP2", 1.1)
    ratio("ours zero3 prefetch", "torch FSDP2", 1.1)


if __name__ == "__main__":
    main()
