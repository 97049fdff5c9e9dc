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
e. (Run inside b.) The seams of issue 21 on CUDA under NCCL (world_size=1; NCCL sends only GPU
   tensors, so every record a check exchanges must live on the GPU): the vocab-parallel cross-
   entropy with ignore_index against F.cross_entropy, PowerSGD's orthonormalisation of bf16/fp16
   factors, two threads running labkit's ring on two groups at once, ZeRO-3's first-step
   lockstep check (section b's ZeRO-3 runs it too).
f. A GEMM sweep: bf16 ``torch.mm`` TFLOP/s over square and transformer shapes, aligned and
   not (k = 4096 against 4095), the data the planner's efficiency curve is calibrated from
   (written to $OUT/gemm_sweep.json with the card and torch version).
g. The GEMMs of a transformer layer over tokens x hidden x tensor-parallel degree
   ($OUT/gemm_grid.json).
h. The 1.3B step pushed further: the vocabulary padded to a multiple of 64 (the head's
   GEMM aligned), ``torch.compile`` of the blocks, other micro-batches, and the unpadded
   step again as the same card's baseline ($OUT/push.json, written as each variant lands).
i. The step taken apart into the planner's named terms (``gpu_step_parts.py``): the layer's
   GEMMs, SDPA per backend, the elementwise work eager and compiled, a block eager and
   compiled, the head at both vocabularies, the optimizer ($OUT/step_parts.json).
j. Host-to-device copies of one input batch (32 uint8 224x224 images, notebook 13's K8):
   pageable against pinned, p50/p90/p99/max over 200 copies (``labkit.measure.h2d``;
   $OUT/h2d.json, to be kept as docs/gpu_h2d_<card>.json, which notebook 13 reads).

Prints one JSON summary at the end (and writes it to $OUT/gpu_check.json when OUT is set).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

# Runnable from a plain checkout: the repository root (labkit's parent) on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def peak_flops(name: str) -> float | None:
    from labkit.measure.capstone import peak_flops as peak

    return peak(name)


def capstone(recompute: str, **kw: Any) -> dict[str, Any]:
    from labkit.measure.capstone import capstone_step

    return capstone_step(recompute, **kw)


# The step pushed further (section h), each variant a point the planner predicts
# (labkit.planner.gpu_checks). Most informative first, so a run cut short keeps the best.
PUSH = (
    ("pad64_none_mb24", "none", {"micro_batch": 24, "pad_vocab_to": 64}),
    ("base_none_mb24", "none", {"micro_batch": 24}),
    ("pad64_none_mb24_compiled", "none",
     {"micro_batch": 24, "pad_vocab_to": 64, "compile_blocks": True}),
    ("pad64_full_mb32", "full", {"micro_batch": 32, "pad_vocab_to": 64}),
    ("pad64_none_mb8", "none", {"micro_batch": 8, "pad_vocab_to": 64}),
    ("pad64_none_mb16", "none", {"micro_batch": 16, "pad_vocab_to": 64}),
    ("pad64_full_mb32_compiled", "full",
     {"micro_batch": 32, "pad_vocab_to": 64, "compile_blocks": True}),
)  # fmt: skip


def step_parts() -> dict[str, Any]:
    from gpu_step_parts import step_parts as parts

    out = parts()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "step_parts.json"), "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out


def push() -> dict[str, Any]:
    """Section h: the 1.3B step with the vocabulary padded to a multiple of 64, with
    ``torch.compile`` of the blocks, at several micro-batches; the unpadded step again on
    the same card as the baseline. Each result is written to $OUT/push.json as it lands."""
    out: dict[str, Any] = {}
    for key, recompute, kw in PUSH:
        t0 = time.perf_counter()
        try:
            out[key] = capstone(recompute, **kw)
        except Exception as e:  # one failing variant must not hide the others
            out[key] = {"error": f"{type(e).__name__}: {e}",
                        "traceback": traceback.format_exc()[-2000:]}  # fmt: skip
        gc.collect()
        torch.cuda.empty_cache()
        out[key]["wall_s"] = time.perf_counter() - t0
        r = out[key]
        print(f"   h {key}: {r.get('tokens_per_s', 0):,.0f} tok/s, MFU {r.get('mfu')}, "
              f"{r.get('max_memory_allocated_GiB')} GiB, {r['wall_s']:.0f} s "
              f"{r.get('error', '')}", flush=True)  # fmt: skip
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "push.json"), "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           **out}, f, indent=1, default=str)  # fmt: skip
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
    attempt("seams", lambda: _seams(dev))
    for name, cls in VARIANTS.items():
        attempt(f"ddp_{name}", lambda cls=cls: ddp_ok(cls))
    for stage in ("zero1", "zero2", "zero3"):
        attempt(f"{stage}_losses", lambda stage=stage: zero_losses(stage))
    return res


def _seams(dev: torch.device) -> dict[str, Any]:
    """Issue 21's fixes on this device (section e): each entry True, or a number to read."""
    import threading

    import torch.distributed as dist
    import torch.nn.functional as F

    from labkit.collectives import Comm
    from labkit.ddp.compression import orthonormalize
    from labkit.tensor_parallel import vocab_parallel_cross_entropy

    out: dict[str, Any] = {}
    torch.manual_seed(0)
    logits = torch.randn(2, 8, 64, device=dev, requires_grad=True)
    tgt = torch.randint(0, 64, (2, 8), device=dev)
    tgt[0, :3] = -100  # padding
    ours = vocab_parallel_cross_entropy(logits, tgt, Comm(None))
    want = F.cross_entropy(logits.reshape(-1, 64), tgt.reshape(-1), ignore_index=-100)
    out["ce_ignore_index_abs_err"] = abs(ours.item() - want.item())
    try:
        vocab_parallel_cross_entropy(logits, torch.full_like(tgt, 64), Comm(None))
        out["ce_out_of_range_raises"] = False
    except IndexError:
        out["ce_out_of_range_raises"] = True
    for dtype in (torch.bfloat16, torch.float16):
        q = orthonormalize(torch.randn(256, 4, device=dev).to(dtype))
        eye = torch.eye(4, device=dev)
        out[f"powersgd_{dtype}_orthogonality_err"] = (
            (q.float().T @ q.float() - eye).abs().max().item()
        )
    groups = [dist.new_group([0]), dist.new_group([0])]
    errors: list[float] = []

    def worker(g: Any) -> None:
        comm = Comm(g, "ring")
        for i in range(50):
            t = torch.full((1 << 16,), float(i), device=dev)
            comm.all_reduce(t)
            errors.append((t - i).abs().max().item())

    threads = [threading.Thread(target=worker, args=(g,)) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["two_threads_ring_max_err"] = max(errors) if len(errors) == 100 else f"{len(errors)} of 100"
    for g in groups:
        dist.destroy_process_group(g)
    return out


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


# --------------------------------------------------------------------------- f. GEMM sweep
def gemm_sweep(device: str = "cuda", sizes: tuple[int, ...] = (256, 512, 1024, 2048, 4096,
               8192, 16384), reps: int = 20) -> dict[str, Any]:  # fmt: skip
    """bf16 (m, n, k) matmul TFLOP/s: median of ``reps`` timed runs after warm-up (CUDA events
    around each run). Square sizes, GPT-2 1.3B's shapes (tokens 8192, h 2048, 4h, the vocab
    50257 and the padded 50304) and k = 4096 against 4095 (tile alignment)."""
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    shapes = [(n, n, n) for n in sizes]
    shapes += [(8192, 2048, 2048), (8192, 8192, 2048), (8192, 2048, 8192), (8192, 6144, 2048),
               (8192, 50257, 2048), (8192, 50304, 2048), (4096, 4096, 4095), (4096, 4096, 4096),
               (4096, 4096, 4104)]  # fmt: skip
    rows = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=dev, dtype=dtype)
        b = torch.randn(k, n, device=dev, dtype=dtype)
        for _ in range(3):
            a @ b
        times = []
        for _ in range(reps):
            if dev.type == "cuda":
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                a @ b
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                a @ b
                times.append(time.perf_counter() - t0)
        times.sort()
        med = times[len(times) // 2]
        rows.append({"m": m, "n": n, "k": k, "seconds": med, "tflops": 2 * m * n * k / med / 1e12})
        del a, b
    out = {"dtype": str(dtype), "device": torch.cuda.get_device_name() if dev.type == "cuda"
           else "cpu", "torch": torch.__version__, "reps": reps, "rows": rows}  # fmt: skip
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gemm_sweep.json"), "w") as f:
            json.dump(out, f, indent=1)
    return out


def transformer_grid() -> dict[str, Any]:
    """Section g: the GEMMs of a transformer layer at planner scale, bf16 TFLOP/s (median of
    10): tokens m in {2048, 8192, 16384} x hidden h in {1024 .. 12288} x tensor-parallel
    t in {1, 2, 4, 8}: QKV (m, 3h/t, h), projection (m, h, h/t), fc (m, 4h/t, h), fc2
    (m, h, 4h/t). Written to $OUT/gemm_grid.json for the planner's efficiency curve."""
    rows = []
    dev = torch.device("cuda")
    for m in (2048, 8192, 16384):
        for h in (1024, 1536, 2048, 2560, 4096, 5120, 8192, 12288):
            for t in (1, 2, 4, 8):
                for name, n, k in (("qkv", 3 * h // t, h), ("proj", h, h // t),
                                   ("fc", 4 * h // t, h), ("fc2", h, 4 * h // t)):  # fmt: skip
                    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
                    for _ in range(2):
                        a @ b
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    times = []
                    for _ in range(10):
                        start.record()
                        a @ b
                        end.record()
                        end.synchronize()
                        times.append(start.elapsed_time(end) / 1e3)
                    med = sorted(times)[5]
                    rows.append({"gemm": name, "m": m, "n": n, "k": k, "h": h, "t": t,
                                 "seconds": med, "tflops": 2 * m * n * k / med / 1e12})  # fmt: skip
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gemm_grid.json"), "w") as f:
            json.dump(out, f, indent=1)
    return {"shapes": len(rows), "min_tflops": min(r["tflops"] for r in rows),
            "max_tflops": max(r["tflops"] for r in rows)}  # fmt: skip


def h2d() -> dict[str, Any]:
    from dataclasses import asdict

    from labkit.measure.h2d import h2d_latency

    shape = (32, 3, 224, 224)
    lat = h2d_latency(shape, repeats=200, warmup=10)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "shape": list(shape), **{k: asdict(v) for k, v in lat.items()}}  # fmt: skip
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "h2d.json"), "w") as f:
            json.dump(out, f, indent=1)
    return out


SECTIONS = {
    "a": None,
    "b": nccl_paths,
    "c": amp,
    "d": tracker,
    "f": gemm_sweep,
    "g": transformer_grid,
    "h": push,
    "i": step_parts,
    "j": h2d,
}


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
                f"== {key} ({summary[key + '_wall_s']:.1f} s): "
                f"{json.dumps(summary[key], default=str)[:2000]}",
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
