"""labkit's activation checkpointing, mixed precision and sharded checkpoints against PyTorch's.

    .venv/bin/python benchmarks/bench_memory_precision.py [--steps 5] [--skip-save]

All on the CPU of the machine it runs on (the dtype is printed on every line). Each pair is
measured interleaved in one run, median over ``--steps`` steps after one warm-up step:

* activation checkpointing (fp32), 4-block GPT, d=128, 8 x 128 tokens: step time and peak
  activation bytes of ``labkit.activation_checkpoint`` vs ``torch.utils.checkpoint``
  (non-reentrant), full policy. Target: time ratio <= 1.10x, memory ratio <= 1.10x.
* loss scaling (fp32 model): a step with ``DynamicLossScaler`` vs ``torch.amp.GradScaler``.
  Target: <= 1.10x.
* mixed precision (bf16): ``MixedPrecisionTrainer`` (bf16 weights, fp32 master) vs
  ``torch.autocast(bfloat16)`` with fp32 weights; both vs plain fp32. Informational: they are
  different recipes (one cast per step vs casts per op).
* sharded save (fp32 state, 2 ranks, gloo): ``save_checkpoint`` (fsync + sha256 included) vs
  ``torch.distributed.checkpoint.save``. Informational.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from labkit.activation_checkpoint import apply_activation_checkpointing, step_activation_bytes
from labkit.launch import launch
from labkit.models import GPT, GPTConfig, gpt_loss
from labkit.precision import DynamicLossScaler, MixedPrecisionTrainer


def _median_times(fns: dict[str, Callable[[], None]], steps: int) -> dict[str, float]:
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(steps):
        for name, fn in fns.items():  # interleaved: load spikes hit both sides
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def _gpt() -> tuple[GPT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=65, block_size=128, n_layer=4, n_head=4, n_embd=128, dropout=0.1)
    return GPT(cfg), torch.randint(0, 65, (8, 128)), torch.randint(0, 65, (8, 128))


def bench_activation(steps: int) -> None:
    base, idx, tgt = _gpt()
    models = {}
    for impl in ("labkit", "torch"):
        models[impl] = copy.deepcopy(base)
        apply_activation_checkpointing(models[impl].blocks, "full", impl=impl)
    models["none"] = base
    fns = {k: (lambda m=m: gpt_loss(m, idx, tgt).backward()) for k, m in models.items()}
    t = _median_times(fns, steps)
    mem = {
        k: step_activation_bytes(m, idx, tgt, loss_fn=gpt_loss)["activations"]
        for k, m in models.items()
    }
    print("\n== activation checkpointing, full policy (fp32, CPU) ==")
    for k in ("none", "labkit", "torch"):
        print(f"  {k:7s} {t[k] * 1e3:8.1f} ms/step   peak activations {mem[k] / 1e6:7.2f} MB")
    print(
        f"  ours/torch: time {t['labkit'] / t['torch']:.2f}x (target <= 1.10), "
        f"memory {mem['labkit'] / mem['torch']:.2f}x (target <= 1.10); "
        f"recompute cost vs none: {t['labkit'] / t['none']:.2f}x time "
        f"for {mem['none'] / mem['labkit']:.1f}x less memory"
    )


def bench_scaler(steps: int) -> None:
    base, idx, tgt = _gpt()
    runs = {}
    for name, scaler in (("labkit", DynamicLossScaler()), ("torch", torch.amp.GradScaler("cpu"))):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, opt=opt, scaler=scaler) -> None:
            opt.zero_grad(set_to_none=True)
            scaler.scale(gpt_loss(model, idx, tgt)).backward()
            scaler.step(opt)
            scaler.update()

        runs[name] = step
    t = _median_times(runs, steps)
    print("\n== loss-scaled training step (fp32 model, CPU) ==")
    print(
        f"  labkit {t['labkit'] * 1e3:.1f} ms, GradScaler {t['torch'] * 1e3:.1f} ms: "
        f"ours/torch {t['labkit'] / t['torch']:.2f}x (target <= 1.10)"
    )


def bench_mixed(steps: int) -> None:
    base, idx, tgt = _gpt()
    fp32 = copy.deepcopy(base)
    fp32_opt = torch.optim.AdamW(fp32.parameters(), lr=1e-4)
    auto = copy.deepcopy(base)
    auto_opt = torch.optim.AdamW(auto.parameters(), lr=1e-4)
    trainer = MixedPrecisionTrainer(copy.deepcopy(base), lambda ps: torch.optim.AdamW(ps, lr=1e-4))

    def plain() -> None:
        fp32_opt.zero_grad(set_to_none=True)
        gpt_loss(fp32, idx, tgt).backward()
        fp32_opt.step()

    def autocast() -> None:
        auto_opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = gpt_loss(auto, idx, tgt)
        loss.backward()
        auto_opt.step()

    def ours() -> None:
        trainer.zero_grad()
        trainer.backward(gpt_loss(trainer.model, idx, tgt))
        trainer.step()

    t = _median_times({"fp32": plain, "autocast": autocast, "labkit": ours}, steps)
    print("\n== mixed precision step, AdamW (CPU) ==")
    print(
        f"  fp32 {t['fp32'] * 1e3:.1f} ms | torch.autocast bf16 {t['autocast'] * 1e3:.1f} ms | "
        f"labkit bf16 weights + fp32 master {t['labkit'] * 1e3:.1f} ms"
    )
    print(
        f"  ours/autocast {t['labkit'] / t['autocast']:.2f}x, "
        f"ours/fp32 {t['labkit'] / t['fp32']:.2f}x"
    )


def _save_job(steps: int) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp

    from labkit.checkpoint import save_checkpoint

    model, _, _ = _gpt()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)).backward()
    opt.step()  # materialise Adam's moments
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    root = tempfile.mkdtemp() if torch.distributed.get_rank() == 0 else ""
    box = [root]
    torch.distributed.broadcast_object_list(box)
    root = box[0]
    out: dict[str, list[float]] = {"labkit": [], "dcp": []}
    for i in range(steps + 1):
        torch.distributed.barrier()
        start = time.perf_counter()
        save_checkpoint(f"{root}/ours", i, state, keep=1)
        out["labkit"].append(time.perf_counter() - start)
        torch.distributed.barrier()
        start = time.perf_counter()
        dcp.save(state, checkpoint_id=f"{root}/dcp_{i}")
        out["dcp"].append(time.perf_counter() - start)
    return {k: statistics.median(v[1:]) for k, v in out.items()}


def bench_save(steps: int) -> None:
    res = launch(_save_job, steps, world_size=2, quiet=True, timeout=300)
    t = {k: max(r[k] for r in res) for k in ("labkit", "dcp")}
    print("\n== sharded save, GPT model + AdamW state (fp32, 2 ranks, gloo, CPU) ==")
    print(
        "  labkit save_checkpoint (model + optimizer, fsync + sha256) "
        f"{t['labkit'] * 1e3:.1f} ms | "
        f"torch.distributed.checkpoint.save (same state) {t['dcp'] * 1e3:.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--skip-save", action="store_true")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    bench_activation(args.steps)
    bench_scaler(args.steps)
    bench_mixed(args.steps)
    if not args.skip_save:
        bench_save(args.steps)


if __name__ == "__main__":
    main()
