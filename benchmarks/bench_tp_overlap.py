"""Overlapped SP (labkit.tensor_parallel.overlap) against the plain SP layer, and PyTorch's path.

One SP MLP layer (column-parallel d -> o with its input all-gathered, ReLU, row-parallel o -> d
with its output reduce-scattered), forward and backward, on ``--world-size`` gloo ranks.
Contenders, interleaved round by round after a warm-up (``labkit.measure.tp_overlap``): the
plain layer, the overlapped one, the same GEMMs alone (compute only) and the four collectives
alone (comm only). Reported: medians with their 95% intervals, the exposed communication of
each layer (its median minus compute only's), the overlap fraction, and the verdict on
"overlapped / plain <= 1" from the paired per-round ratios (``bench_cells.verdict``).

PyTorch's own async-TP is ``torch.ops.symm_mem.fused_all_gather_matmul`` /
``fused_matmul_reduce_scatter`` (``torch.distributed._symmetric_memory``): in torch 2.13 they
have no CPU kernel ("Could not run 'symm_mem::fused_all_gather_matmul' with arguments from the
'CPU' backend", measured here), so the run prints that error; their CPU-capable
``_fused_*_fallback`` functions are the unfused all-gather then matmul (and matmul then
reduce-scatter), timed forward-only against our overlapped forward as the nearest peer.

    .venv/bin/python benchmarks/bench_tp_overlap.py                 # 2 ranks
    .venv/bin/python benchmarks/bench_tp_overlap.py --world-size 4 --steps 9
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from labkit import launch
from labkit.measure.bench_cells import median_interval, verdict


def _torch_peer(shape: tuple[int, int, int, int]) -> dict[str, Any]:
    """PyTorch's async-TP op (its error on CPU) and its fallback vs our forward, interleaved."""
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm
    from torch import nn

    from labkit.collectives import Comm
    from labkit.measure.timing import interleaved_times
    from labkit.tensor_parallel.overlap import OverlappedColumnLinear, OverlappedRowLinear

    B, T, d, o = shape
    r, t = dist.get_rank(), dist.get_world_size()
    name = dist.group.WORLD.group_name  # type: ignore[union-attr]
    a = torch.randn(T // t * B, d)  # (T/t B, d): sequence-first rows, flattened
    w1, w2 = torch.randn(d, o // t), torch.randn(o // t, d)
    try:
        torch.ops.symm_mem.fused_all_gather_matmul(a, [w1], gather_dim=0, group_name=name)
        native = "ran"
    except Exception as exc:  # noqa: BLE001 - reported: no CPU kernel
        native = f"{type(exc).__name__}: {str(exc).splitlines()[0][:110]}"
    torch.manual_seed(0)
    comm = Comm(None, "torch")
    col = OverlappedColumnLinear(nn.Linear(d, o), comm)
    row = OverlappedRowLinear(nn.Linear(o, d), comm)
    x = torch.randn(B, T // t, d)

    def theirs() -> None:
        _, (h,) = symm._fused_all_gather_matmul_fallback(a, [w1], 0, name)  # (T B, o/t)
        symm._fused_matmul_reduce_scatter_fallback(torch.relu(h), w2, "sum", 0, name)

    def ours() -> None:
        with torch.no_grad():
            row(torch.relu(col(x)))

    times = interleaved_times({"ours": ours, "theirs": theirs}, 9, sync=dist.barrier)
    return {"native": native, "times": times, "rank": r}


def _worker(shape: tuple[int, int, int, int], steps: int) -> dict[str, Any]:
    from labkit.measure.tp_overlap import measure_overlap

    out = measure_overlap(shape, steps=steps)
    out["torch"] = _torch_peer(shape)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument(
        "--shape", type=int, nargs=4, default=[4, 256, 256, 1024], metavar=("B", "T", "D", "O")
    )
    args = ap.parse_args(argv)
    B, T, d, o = args.shape
    if T % args.world_size or o % args.world_size or args.steps < 6:
        raise SystemExit(
            f"need T={T} and O={o} divisible by --world-size {args.world_size}, steps >= 6"
        )
    res = launch(_worker, tuple(args.shape), args.steps, world_size=args.world_size, timeout=600,
                 env={"OMP_NUM_THREADS": "1"})[0]  # fmt: skip
    print(f"one SP MLP layer, B={B} T={T} d={d} o={o}, tp={args.world_size} gloo ranks, rank 0, "
          f"{args.steps} interleaved rounds")  # fmt: skip
    for name, values in res["times"].items():
        lo, hi = median_interval(values)
        med = statistics.median(values) * 1e3
        print(f"  {name:13s} median {med:8.1f} ms   95% [{lo * 1e3:.1f}, {hi * 1e3:.1f}]")
    for name, sec in res["exposed"].items():
        print(f"  exposed communication + overheads, {name:10s}: {sec * 1e3:8.1f} ms")
    print(
        f"  overlap fraction (1: comm or compute, the shorter, fully hidden): {res['overlap']:.2f}"
    )
    print("  overlapped vs plain:", verdict(res["times"]["overlapped"], res["times"]["plain"]))
    peer = res["torch"]
    print(f"PyTorch async-TP (symm_mem.fused_all_gather_matmul) on CPU: {peer['native']}")
    print("  forward only, ours (overlapped) vs torch's _fused_*_fallback (unfused):",
          verdict(peer["times"]["ours"], peer["times"]["theirs"]))  # fmt: skip


if __name__ == "__main__":
    main()
