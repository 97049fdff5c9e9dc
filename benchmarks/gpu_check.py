"""One prepared GPU check (H100/H200): the capstone's 1.3B step and labkit's GPU paths.

Run from the repository root with labkit importable (``pip install -e .`` or PYTHONPATH=.):

    python benchmarks/gpu_check.py            # all sections, < 6 minutes on an H100
    python benchmarks/gpu_check.py a c        # only some sections

Sections (each in its own try/except: one failing section never hides the others):

a. The GPT-2 1.3B step (notebook 11's GPU path): bf16 parameters with fp32 master weights
   and fused AdamW (stepped in chunks, so the fp32 gradient copy is one chunk at a time),
   SDPA attention, activation checkpointing of every block (and a run without it). The
   micro-batch is the largest that ``labkit.memory.estimate`` says fits in 85% of the card.
   Reports tokens/s, MFU = tokens/s * (6N + 12*L*h*s) / peak (N: parameters without the
   position embedding, which is a lookup; 12*L*h*s: attention's score and value matmuls,
   forward and backward; recompute's extra forward is not model FLOPs), and
   ``torch.cuda.max_memory_allocated`` against the estimate's ``peak_allocated``.
b. ``labkit.launch`` at world_size=1 with backend="nccl": Comm (torch and ring) all_reduce,
   reduce_scatter, all_gather; one step of each DDP variant; one step of ZeRO-1/2/3.
c. AMP: labkit's DynamicLossScaler against torch.amp.GradScaler (fp16 autocast), time per
   step interleaved, ratio ours/torch; and a bf16 autocast step.
d. labkit.memory.tracker.CudaMemoryTracker against torch.cuda.max_memory_allocated.

Prints one JSON summary at the end (and writes it to $OUT/gpu_check.json when OUT is set).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from typing import Any

import torch

# bf16 dense peak FLOP/s (no sparsity), from the vendors' data sheets
PEAKS = [
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),
]


def peak_flops(name: str) -> float | None:
    for key, flops in PEAKS:
        if key.lower() in name.lower():
            return flops
    return None


def model_flops_per_token(cfg: Any, seq: int) -> tuple[int, float]:
    """(N, 6N + 12*L*h*s): PaLM's (Chowdhery et al. 2022, appendix B) model FLOPs per token."""
    n = cfg.num_params() - cfg.block_size * cfg.n_embd  # the position embedding is a lookup
    return n, 6 * n + 12 * cfg.n_layer * cfg.n_embd * seq


# --------------------------------------------------------------------------- a. 1.3B step
class ChunkedMixedAdamW:
    """bf16 model parameters, fp32 master weights, fused AdamW stepped chunk by chunk: the
    ZeRO paper's 2 + 2 + 12 bytes per parameter plus one chunk's fp32 gradients."""

    def __init__(self, params: list[torch.nn.Parameter], chunk: int, lr: float = 1e-4) -> None:
        self.params = params
        self.master = [p.detach().float().clone() for p in params]  # before the bf16 cast
        self.chunks: list[list[int]] = [[]]
        size = 0
        for i, p in enumerate(params):
            if size and size + p.numel() > chunk:
                self.chunks.append([])
                size = 0
            self.chunks[-1].append(i)
            size += p.numel()
        self.opts = [
            torch.optim.AdamW([self.master[i] for i in idx], lr=lr, fused=True, weight_decay=0.1)
            for idx in self.chunks
        ]

    @torch.no_grad()
    def step(self) -> None:
        for idx, opt in zip(self.chunks, self.opts):
            for i in idx:
                self.master[i].grad = self.params[i].grad.float()
                self.params[i].grad = None
            opt.step()
            for i in idx:
                self.params[i].copy_(self.master[i])
                self.master[i].grad = None


def capstone(recompute: str, steps: int = 6, warmup: int = 3) -> dict[str, Any]:
    from labkit.activation_checkpoint import apply_activation_checkpointing
    from labkit.memory.estimate import GIB, TrainSetup, estimate
    from labkit.models import GPT, lm_loss, preset

    dev = torch.device("cuda")
    cfg = preset("gpt2-1.3b")
    seq, chunk = cfg.block_size, 64 * 2**20
    capacity = torch.cuda.get_device_properties(dev).total_memory
    setup = TrainSetup(precision="bf16", recompute=recompute, grad_chunk_params=chunk)
    batches = [
        b
        for b in (32, 24, 16, 12, 8, 6, 4, 2, 1)
        if estimate(cfg, setup, micro_batch=b).total < 0.85 * capacity
    ]
    b = batches[0]
    est = estimate(cfg, setup, micro_batch=b)
    torch.manual_seed(0)
    with dev:
        model = GPT(cfg)  # fp32 first: the master weights are copied exactly
    params = list(model.parameters())
    opt = ChunkedMixedAdamW(params, chunk)
    model.to(torch.bfloat16)
    if recompute == "full":
        apply_activation_checkpointing(model.blocks, "full", impl="torch")
    x = torch.randint(0, cfg.vocab_size, (b, seq), device=dev)
    y = torch.roll(x, -1, 1)

    def step() -> float:
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    measured = torch.cuda.max_memory_allocated()
    dt = statistics.median(times)
    n, fpt = model_flops_per_token(cfg, seq)
    tokens = b * seq / dt
    peak = peak_flops(torch.cuda.get_device_name())
    out = {
        "recompute": recompute,
        "micro_batch": b,
        "seq": seq,
        "params": cfg.num_params(),
        "N_for_flops": n,
        "flops_per_token": fpt,
        "flops_formula": "6N + 12*L*h*s",
        "step_s_median": dt,
        "step_s_min_max": [min(times), max(times)],
        "tokens_per_s": tokens,
        "mfu": tokens * fpt / peak if peak else None,
        "peak_flops": peak,
        "loss_first_last": [losses[0], losses[-1]],
        "max_memory_allocated_GiB": measured / GIB,
        "predicted_peak_allocated_GiB": est.peak_allocated / GIB,
        "predicted_over_measured": est.peak_allocated / measured,
        "predicted_by_category_GiB": {k: v / GIB for k, v in est.by_category().items()},
    }
    return out


# --------------------------------------------------------------------------- b. nccl paths
def _nccl_rank() -> dict[str, Any]:
    import torch.distributed as dist

    from labkit.collectives import Comm
    from labkit.ddp import VARIANTS
    from labkit.launch import local_device
    from labkit.models import GPT, GPTConfig, gpt_loss
    from labkit.zero import make_optimizer

    dev = local_device()
    res: dict[str, Any] = {"backend": dist.get_backend(), "device": str(dev)}

    def attempt(key: str, fn: Any) -> None:
        try:
            res[key] = fn()
        except Exception as e:  # report and go on with the next path
            res[key] = f"error: {type(e).__name__}: {e}"

    def comm_ok(impl: str) -> bool:
        comm = Comm(None, impl)
        t = torch.arange(10, dtype=torch.float32, device=dev)
        ref = t.clone()
        comm.all_reduce(t)
        shard = torch.empty(10, device=dev)
        comm.reduce_scatter(shard, ref.clone())
        full = torch.empty(10, device=dev)
        comm.all_gather(full, ref.clone())
        return bool(torch.equal(t, ref) and torch.equal(shard, ref) and torch.equal(full, ref))

    cfg = GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=4, n_embd=128)
    x = torch.randint(0, 128, (4, 64), device=dev)
    y = torch.roll(x, -1, 1)

    def ddp_ok(cls: Any) -> bool:
        torch.manual_seed(0)
        model = GPT(cfg).to(dev)
        ddp = cls(model)
        gpt_loss(ddp, x, y).backward()
        ddp.finish_gradient_sync()
        return all(
            p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters()
        )

    def zero_losses(stage: str) -> list[float]:
        torch.manual_seed(0)
        model = GPT(cfg).to(dev)
        opt = make_optimizer(stage, model)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = gpt_loss(model, x, y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses  # falling: the steps train

    for impl in ("torch", "ring"):
        attempt(f"comm_{impl}", lambda impl=impl: comm_ok(impl))
    for name, cls in VARIANTS.items():
        attempt(f"ddp_{name}", lambda cls=cls: ddp_ok(cls))
    for stage in ("zero1", "zero2", "zero3"):
        attempt(f"{stage}_losses", lambda stage=stage: zero_losses(stage))
    return res


def nccl_paths() -> dict[str, Any]:
    import labkit

    t0 = time.perf_counter()
    out = labkit.launch(_nccl_rank, world_size=1, backend="nccl", timeout=180, quiet=True)[0]
    out["wall_s"] = time.perf_counter() - t0
    return out


# --------------------------------------------------------------------------- c. AMP
def amp() -> dict[str, Any]:
    from labkit.measure.timing import interleaved_times, spread
    from labkit.models import GPT, gpt_loss, preset
    from labkit.precision import DynamicLossScaler

    dev = torch.device("cuda")
    cfg = preset("gpt2")
    x = torch.randint(0, cfg.vocab_size, (8, 1024), device=dev)
    y = torch.roll(x, -1, 1)

    def make(scaler: Any, dtype: torch.dtype) -> Any:
        torch.manual_seed(0)
        model = GPT(cfg).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=dtype):
                loss = gpt_loss(model, x, y)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()

        return step

    fns = {
        "labkit_fp16": make(DynamicLossScaler(sync_found_inf=False), torch.float16),
        "torch_fp16": make(torch.amp.GradScaler("cuda"), torch.float16),
        "bf16": make(None, torch.bfloat16),
    }
    times = interleaved_times(fns, steps=10, warmup=3, sync=torch.cuda.synchronize)
    med = {k: spread(v).median for k, v in times.items()}
    out = {f"{k}_ms": v * 1e3 for k, v in med.items()}
    out["ours_over_torch_fp16"] = med["labkit_fp16"] / med["torch_fp16"]
    return out


# --------------------------------------------------------------------------- d. tracker
def tracker() -> dict[str, Any]:
    from labkit.memory import CudaMemoryTracker
    from labkit.models import GPT, gpt_loss, preset

    dev = torch.device("cuda")
    cfg = preset("small-lab")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with CudaMemoryTracker(dev) as mt:
        model = GPT(cfg).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, cfg.vocab_size, (16, cfg.block_size), device=dev)
        for _ in range(2):
            opt.zero_grad()
            gpt_loss(model, x, torch.roll(x, -1, 1)).backward()
            opt.step()
        torch.cuda.synchronize()
        ledger = mt.ledger()
        raw_peak = torch.cuda.max_memory_allocated() - base
        live = sum(ledger.current.values())
        raw_now = torch.cuda.memory_allocated() - base
    return {
        "tracker_peak_bytes": ledger.peak_bytes,
        "max_memory_allocated_minus_base": raw_peak,
        "peak_equal": ledger.peak_bytes == raw_peak,
        "categorised_live_bytes": live,
        "memory_allocated_minus_base": raw_now,
        "live_over_allocated": live / raw_now if raw_now else None,
        "current_by_category": ledger.current,
    }


SECTIONS = {"a": None, "b": nccl_paths, "c": amp, "d": tracker}


def main(argv: list[str]) -> int:
    wanted = argv or list(SECTIONS)
    summary: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
    }
    if not torch.cuda.is_available():
        print(
            "gpu_check: torch.cuda is not available on this machine: nothing to measure.",
            flush=True,
        )
        print(json.dumps(summary, indent=1))
        return 0
    summary["device"] = torch.cuda.get_device_name()
    summary["peak_bf16_flops"] = peak_flops(summary["device"])
    t_all = time.perf_counter()
    for name in wanted:
        jobs = (
            {"a_full": lambda: capstone("full"), "a_none": lambda: capstone("none")}
            if name == "a"
            else {name: SECTIONS[name]}
        )
        for key, fn in jobs.items():
            t0 = time.perf_counter()
            try:
                summary[key] = fn()  # type: ignore[misc]
            except Exception as e:  # a failing section must not hide the others
                summary[key] = {
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc()[-3000:],
                }
                torch.cuda.empty_cache()
            torch.cuda.empty_cache()
            summary[key + "_wall_s"] = time.perf_counter() - t0
            print(
                f"== {key} ({summary[key + '_wall_s']:.1f} s): {json.dumps(summary[key], default=str)[:2000]}",
                flush=True,
            )
    summary["wall_s"] = time.perf_counter() - t_all
    text = json.dumps(summary, indent=1, default=str)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_check.json"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
