"""Pipeline parallelism, ours vs ``torch.distributed.pipelining``, in one run (gloo on CPU).

    ours GPipe / torch ScheduleGPipe    target <= 1.0x
    ours 1F1B  / torch Schedule1F1B     target <= 1.0x

The same GPT (untied head: PyTorch's stages do not share a weight across ranks), cut into
the same stages from the same seed, the same m micro-batches; one step = forward and backward
of all m micro-batches (no optimizer). The four contenders are interleaved step by step
(``labkit.measure.timing.interleaved_times``, a barrier before and after each), warm-up
dropped, medians reported with their spread; rank 0's clock. The script also checks that
ours and PyTorch's produce the same loss. On a shared 2-core machine expect +-20% run to run;
with 4 ranks on 2 cores the ranks time-share the cores, which favours neither side.

Usage: .venv/bin/python benchmarks/bench_pipeline.py [--ranks 2] [--m 8] [--steps 8]
"""

from __future__ import annotations

import argparse

from labkit import launch
from labkit.models import GPTConfig


def job(cfg: GPTConfig, p: int, m: int, mb: int, seq: int, steps: int, warmup: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from labkit.measure.timing import interleaved_times, spread
    from labkit.models import GPT, lm_loss
    from labkit.pipeline import make_schedule
    from labkit.pipeline.executor import pipeline_step
    from labkit.pipeline.stages import build_stages

    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, cfg.vocab_size, (m * mb, seq + 1), generator=g)
    x, y = data[:, :-1], data[:, 1:]  # (m * mb, seq) each
    xs, ys = list(x.chunk(m)), list(y.chunk(m))  # m micro-batches of (mb, seq)
    ours_chunks = build_stages(model, rank, p)
    torch_chunk = build_stages(model, rank, p)[0]
    shape = (mb, seq, cfg.n_embd)
    out: dict = {"losses": {}}

    def ours(name: str):
        sched = make_schedule(name, p, m)

        def step() -> None:
            for q in ours_chunks[0].parameters():
                q.grad = None
            res = pipeline_step(sched, ours_chunks, xs, ys, shape, barrier=False)
            out["losses"][f"ours {name}"] = res.loss

        return step

    def theirs(cls):
        stage = PipelineStage(torch_chunk, rank, p, torch.device("cpu"))
        sch = cls(stage, n_microbatches=m, loss_fn=lm_loss)

        def step() -> None:
            for q in torch_chunk.parameters():
                q.grad = None
            losses: list = []
            if rank == 0:
                sch.step(x)
            elif rank == p - 1:
                sch.step(target=y, losses=losses)
                out["losses"][cls.__name__] = sum(float(v) for v in losses) / m
            else:
                sch.step()

        return step

    fns = {
        "ours gpipe": ours("gpipe"),
        "torch ScheduleGPipe": theirs(ScheduleGPipe),
        "ours 1f1b": ours("1f1b"),
        "torch Schedule1F1B": theirs(Schedule1F1B),
    }
    times = interleaved_times(fns, steps, warmup, sync=dist.barrier)
    out["times"] = {k: spread(v) for k, v in times.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--mb", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    from labkit.pipeline.stages import check_pipeline

    check_pipeline(args.layers, args.ranks, args.m, "1f1b")
    cfg = GPTConfig(
        n_layer=args.layers, n_embd=args.embd, n_head=4, block_size=args.seq, tie_weights=False
    )
    per_rank = launch(
        job,
        cfg,
        args.ranks,
        args.m,
        args.mb,
        args.seq,
        args.steps,
        args.warmup,
        world_size=args.ranks,
        timeout=900,
        quiet=True,
    )
    times = per_rank[0]["times"]
    losses = per_rank[-1]["losses"]
    print(
        f"GPT {args.layers} x {args.embd} ({cfg.num_params() / 1e6:.2f}M params), "
        f"{args.ranks} ranks, "
        f"m={args.m} micro-batches of {args.mb} x {args.seq}"
    )
    for name, sp in times.items():
        key = name if name.startswith("ours") else name.split()[1]
        print(f"{name:>22}: {sp}   loss {losses[key]:.6f}")
    for ours_name, theirs_name in (
        ("ours gpipe", "torch ScheduleGPipe"),
        ("ours 1f1b", "torch Schedule1F1B"),
    ):
        loss_a, loss_b = losses[ours_name], losses[theirs_name.split()[1]]
        if abs(loss_a - loss_b) > 1e-4 * abs(loss_b):
            raise SystemExit(f"{ours_name} loss {loss_a} differs from {theirs_name}'s {loss_b}")
        x = times[ours_name].median / times[theirs_name].median
        print(
            f"{ours_name} / {theirs_name}: {x:.2f}x (target <= 1.0x) {'OK' if x <= 1.0 else 'MISS'}"
        )


if __name__ == "__main__":
    main()
