"""Ring attention against full attention on one process, Ulysses, and torch's own CP API.

Every contender runs forward + backward of causal attention on the same (b, h, s, d) inputs,
interleaved round by round (warm-up dropped, medians with their spread):

* ``ring zigzag`` / ``ring contiguous``: labkit's ring on cp ranks, the two splits;
* ``ulysses``: labkit's all-to-all head swap, torch's fused SDPA locally;
* ``full (1 process)``: torch's fused ``scaled_dot_product_attention`` on the whole sequence,
  on rank 0 while the other ranks wait (the single-process baseline a ring must beat in
  memory, and approach in time per rank).

Then the ring's measured numbers against the formulas (saved bytes per rank, bytes per
step), the overlap it achieves, and the work per rank of each split.

Peer: ``torch.distributed.tensor.experimental.context_parallel`` is tried first; in torch 2.13
on CPU it refuses (no sharding strategy for the CPU flash kernel; under the math kernel
DTensor rejects a mixed Tensor/DTensor add), and the error is printed. It needs CUDA.

Timings on a shared 2-core machine are noisy: read the medians, and the ratios only roughly.

    .venv/bin/python benchmarks/bench_context_parallel.py            # cp = 2
    .venv/bin/python benchmarks/bench_context_parallel.py --cp 4 --seq 2048
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
import torch.nn.functional as F

from labkit import launch


def _peer_status(b: int, h: int, s: int, d: int) -> str:
    """Try torch's experimental context parallelism on this machine; say what happened."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.tensor.experimental import context_parallel
    except ImportError as exc:
        return f"not importable: {exc}"
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        return f"does not run here: {type(exc).__name__}: {str(exc)[:160]}"
    return "ran"


def _bench(b: int, h: int, s: int, d: int, steps: int) -> dict[str, Any]:
    import torch.distributed as dist

    from labkit.context_parallel import ring_attention, shard_sequence, ulysses_attention
    from labkit.measure.timing import interleaved_times

    rank, cp = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(b, h, s, d, generator=g) for _ in range(4)]

    def ring(scheme: str) -> None:
        leaves = [shard_sequence(t, cp, rank, scheme).requires_grad_() for t in full[:3]]
        out = ring_attention(*leaves, causal=True, scheme=scheme)
        out.backward(shard_sequence(full[3], cp, rank, scheme))

    def ulysses() -> None:
        leaves = [shard_sequence(t, cp, rank, "contiguous").requires_grad_() for t in full[:3]]
        out = ulysses_attention(*leaves, causal=True)
        out.backward(shard_sequence(full[3], cp, rank, "contiguous"))

    def one_process() -> None:
        if rank == 0:
            leaves = [t.clone().requires_grad_() for t in full[:3]]
            F.scaled_dot_product_attention(*leaves, is_causal=True).backward(full[3])

    fns = {
        "ring zigzag": lambda: ring("zigzag"),
        "ring contiguous": lambda: ring("contiguous"),
        "full (1 process)": one_process,
    }
    if h % cp == 0:
        fns["ulysses"] = ulysses
    times = interleaved_times(fns, steps, warmup=2, sync=dist.barrier)
    return {"times": times, "peer": _peer_status(b, h, s, d)}


def main() -> None:
    from labkit.context_parallel.cost import ring_activation_bytes, ring_sent_per_step
    from labkit.measure.context_parallel import (
        full_attention_saved,
        overlap_fraction,
        ring_measurements,
    )
    from labkit.measure.timing import spread

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--steps", type=int, default=7)
    args = ap.parse_args()
    b, h, s, d, cp = 1, args.heads, args.seq, args.head_dim, args.cp
    env = {"OMP_NUM_THREADS": "1"}
    res = launch(_bench, b, h, s, d, args.steps, world_size=cp, timeout=600, env=env)
    print(f"causal attention fwd+bwd, b={b} h={h} s={s} d={d}, cp={cp} (gloo, CPU)")
    worst = {n: max(statistics.median(r["times"][n]) for r in res) for n in res[0]["times"]}
    for name in res[0]["times"]:
        print(f"  {name:<18} {spread(res[0]['times'][name])}  (slowest rank median "
              f"{worst[name] * 1e3:.2f} ms)")  # fmt: skip
    base = worst["full (1 process)"]
    for name in worst:
        if name != "full (1 process)":
            print(f"  ratio {name} / full (1 process): {worst[name] / base:.2f}x")
    print(f"  peer torch context_parallel: {res[0]['peer']}")
    m = launch(ring_measurements, b, h, s, d, True, args.steps, world_size=cp, timeout=600,
               env=env)  # fmt: skip
    print(f"saved for backward per rank: measured {m[0]['saved']} B, formula "
          f"{ring_activation_bytes(b, h, s, d, cp, 4)} B; one process "
          f"{full_attention_saved(b, h, s, d)}")  # fmt: skip
    print(f"bytes sent per step (forward, backward, last hop): {m[0]['sent']}, formula "
          f"{ring_sent_per_step(b, h, s, d, cp, 4)}")  # fmt: skip
    for r, mr in enumerate(m):
        sec = {k: f"{v * 1e3:.1f}" for k, v in mr["seconds"].items()}
        saved = (mr["seconds"]["serial"] - mr["seconds"]["overlapped"]) * 1e3
        print(f"rank {r}: ms {sec}, overlap {overlap_fraction(mr['seconds']):.2f} (posting "
              f"first saves {saved:.1f} ms); compute ms "
              f"contiguous {mr['scheme_seconds']['contiguous'] * 1e3:.1f}, zigzag "
              f"{mr['scheme_seconds']['zigzag'] * 1e3:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
