"""Step-time overhead of a synchronous against an asynchronous checkpoint save (issue 25).

    .venv/bin/python benchmarks/bench_checkpoint.py [--rounds 7] [--window 4] [--embd 256]

One process, a GPT trained with AdamW on the CPU. A *window* is ``--window`` training steps
with one save after its first step; each round runs one window per mode, interleaved (none,
sync, async, in a rotating order), so machine load drifts over all modes alike. Printed:
the median window time per mode and the overhead per save (median window minus the none
window's), the checkpoint size, and for async the part the training thread paid (snapshot +
start) and the background write's own duration. On a shared 2-core machine the background
writer competes with training for the cores (``--threads`` = 1, the default, leaves it one;
with as many OpenMP threads as cores every parallel region waits for the descheduled one),
so async overhead here is an upper bound of what a GPU job, whose CPU idles, sees; numbers
are noisy, compare medians only.
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    from labkit.checkpoint import AsyncCheckpointer, save_checkpoint
    from labkit.models.gpt import GPT, GPTConfig, lm_loss
    from labkit.viz.table import format_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--window", type=int, default=4, help="steps per window (one save)")
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1 leaves a core to the writer)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=args.embd)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (8, cfg.block_size + 1))

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()

    def state() -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    root = tempfile.mkdtemp(prefix="bench-ckpt-")
    saver = AsyncCheckpointer(f"{root}/async", keep=2)
    save_cost: list[float] = []
    write_cost: list[float] = []
    step = 0

    def window(mode: str) -> float:
        nonlocal step
        start = time.perf_counter()
        for i in range(args.window):
            train_step()
            step += 1
            if i == 0 and mode == "sync":
                save_checkpoint(f"{root}/sync", step, state(), keep=2)
            elif i == 0 and mode == "async":
                t0 = time.perf_counter()
                handle = saver.save(step, state())
                save_cost.append(time.perf_counter() - t0)
        if mode == "async":
            handle.wait()  # inside the window: a write longer than the window is paid here
            write_cost.append(handle.seconds)
        return time.perf_counter() - start

    for _ in range(2):  # warm-up: allocator, first file writes, snapshot buffers
        train_step()
        for mode in ("sync", "async"):
            window(mode)
    modes = ["none", "sync", "async"]
    times: dict[str, list[float]] = {m: [] for m in modes}
    save_cost.clear()
    write_cost.clear()
    for r in range(args.rounds):
        for mode in modes[r % 3 :] + modes[: r % 3]:
            times[mode].append(window(mode))
    saver.wait()
    nbytes = sum(p.stat().st_size for p in Path(f"{root}/sync").rglob("*.pt"))
    med = {m: statistics.median(v) for m, v in times.items()}
    params = sum(p.numel() for p in model.parameters())
    print(f"GPT {params / 1e6:.2f} M parameters, checkpoint {nbytes / 2**20:.1f} MiB, "
          f"{args.rounds} rounds of {args.window}-step windows, one save each")  # fmt: skip
    rows = [[m, f"{med[m] * 1e3:.0f}", f"{(med[m] - med['none']) * 1e3:+.0f}"] for m in modes]
    print(format_table(["mode", "window ms (median)", "overhead per save ms"], rows))
    print(f"async: the training thread paid {statistics.median(save_cost) * 1e3:.1f} ms "
          f"(snapshot + start); the background write took "
          f"{statistics.median(write_cost) * 1e3:.0f} ms (medians)")  # fmt: skip


if __name__ == "__main__":
    main()
