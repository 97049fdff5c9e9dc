"""Section i of ``gpu_check.py``: the 1.3B step taken apart, one named planner term at a time.

The planner (``labkit.planner.timing``) prices one layer as ``gemm + attention + elementwise``
and the step as ``layers x layer + head + optimizer``. Here each term is timed alone on the
GPU, at the capstone's shapes (GPT-2 1.3B, micro-batch ``b`` x 2048 tokens, bf16), so a
miss in the whole-step prediction can be traced to the term that makes it:

* ``gemm``: the layer's six ``nn.Linear`` (q, k, v, proj, fc, fc2) forward and backward;
* ``attention``: ``F.scaled_dot_product_attention`` (causal) forward, and forward plus
  backward, under each backend torch offers (flash, cuDNN, memory-efficient) and its default;
* ``elementwise``: two LayerNorms, GELU on 4h and two residual adds, forward and backward,
  eager and under ``torch.compile``;
* ``block``: one whole ``Block`` forward and backward, eager and compiled;
* ``head``: the logits GEMM and the cross-entropy, forward and backward, vocabulary 50,257
  and 50,304;
* ``optimizer``: ``ChunkedMixedAdamW.step`` over the 1.3B parameters.

Every time is the median of ``reps`` runs timed with CUDA events after warm-up; inputs are
random (never zeros). ``python benchmarks/gpu_check.py i``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def _median_s(fn: Callable[[], Any], reps: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if not torch.cuda.is_available():  # a dry run of this script on a CPU
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            continue
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _fwd_bwd(module: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], None]:
    grad = torch.randn_like(module(x))

    def run() -> None:
        module(x).backward(grad)

    return run


class _Elementwise(torch.nn.Module):
    """A block's memory-bound work alone: LayerNorm, residual add, LayerNorm, GELU on 4h,
    residual add (the GEMMs and attention between them left out; a fixed 4h input stands in
    for fc's output)."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)

    def forward(self, x: torch.Tensor, wide: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x + self.ln1(x)
        return y + self.ln2(y), F.gelu(wide)


def _attention(b: int, s: int, h: int, a: int, dev: torch.device, reps: int) -> dict[str, Any]:
    """Causal SDPA per backend, forward alone and forward + backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dt = torch.bfloat16
    q, k, v = (torch.randn(b, a, s, h // a, device=dev, dtype=dt, requires_grad=True)
               for _ in range(3))  # fmt: skip
    go = torch.randn(b, a, s, h // a, device=dev, dtype=dt)
    flops_fwd = 4 * b * s * s * h * 0.5  # causal: half the score tiles

    def fwd() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    backends = {"default": None, "flash": SDPBackend.FLASH_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}  # fmt: skip
    att: dict[str, Any] = {}
    for name, backend in backends.items():
        try:
            with sdpa_kernel(backend) if backend is not None else torch.enable_grad():
                f = _median_s(fwd, reps)
                fb = _median_s(lambda: fwd().backward(go), reps)
            att[name] = {"fwd_s": f, "fwd_bwd_s": fb, "fwd_tflops": flops_fwd / f / 1e12,
                         "bwd_tflops": 2.5 * flops_fwd / (fb - f) / 1e12}  # fmt: skip
        except Exception as e:  # a backend this build lacks
            att[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return att


def _block_parts(cfg: Any, b: int, dev: torch.device, reps: int) -> dict[str, float]:
    """The six linears, the elementwise work (eager, compiled), the block (eager, compiled)."""
    from labkit.models.gpt import Block

    dt, s, h = torch.bfloat16, cfg.block_size, cfg.n_embd
    block = Block(cfg).to(dev, dt)
    x = torch.randn(b, s, h, device=dev, dtype=dt, requires_grad=True)
    wide = torch.randn(b, s, 4 * h, device=dev, dtype=dt, requires_grad=True)
    lin = block.attn
    gemm = sum(
        _median_s(_fwd_bwd(layer, inp), reps)
        for layer, inp in (
            (lin.q, x),
            (lin.k, x),
            (lin.v, x),
            (lin.proj, x),
            (block.mlp.fc, x),
            (block.mlp.proj, wide),
        )  # fmt: skip
    )
    ew = _Elementwise(h).to(dev, dt)
    gx, gw = torch.randn_like(x), torch.randn_like(wide)

    def ew_run(mod: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
        def run() -> None:
            y1, y2 = mod(x, wide)
            torch.autograd.backward((y1, y2), (gx, gw))

        return run

    return {
        "gemm_s": gemm,
        "elementwise_s": _median_s(ew_run(ew), reps),
        "elementwise_compiled_s": _median_s(ew_run(torch.compile(ew)), reps),
        "block_s": _median_s(_fwd_bwd(block, x), reps),
        "block_compiled_s": _median_s(_fwd_bwd(torch.compile(block), x), reps),
    }


def _head(T: int, h: int, vocab: int, real_vocab: int, dev: torch.device, reps: int) -> float:
    """The logits GEMM and the cross-entropy, forward and backward."""
    xs = torch.randn(T, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(vocab, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    tgt = torch.randint(0, real_vocab, (T,), device=dev)
    return _median_s(lambda: F.cross_entropy(xs @ w.t(), tgt).backward(), reps)


def _optimizer(cfg: Any, dev: torch.device) -> float:
    """The capstone's chunked mixed AdamW step over the model's parameters."""
    from labkit.measure.capstone import ChunkedMixedAdamW
    from labkit.models import GPT

    with dev:
        model = GPT(cfg)
    params = list(model.parameters())
    opt = ChunkedMixedAdamW(params, 64 * 2**20, fused=dev.type == "cuda")
    model.to(torch.bfloat16)
    grads = [torch.randn_like(p) for p in params]

    def opt_step() -> None:
        for p, g in zip(params, grads):
            p.grad = g  # a reference, no kernel: the step alone is timed
        opt.step()

    return _median_s(opt_step, reps=5, warmup=2)


def step_parts(micro_batch: int = 24, reps: int = 10, preset_name: str = "gpt2-1.3b",
               device: str = "cuda") -> dict[str, Any]:  # fmt: skip
    from labkit.measure.capstone import padded_vocab
    from labkit.models import preset
    from labkit.planner.roofline import CHIPS
    from labkit.planner.timing import attention_time, head_time, layer_time

    dev = torch.device(device)
    cfg = preset(preset_name)
    padded = padded_vocab(cfg.vocab_size, 64)
    b, s, h, a = micro_batch, cfg.block_size, cfg.n_embd, cfg.n_head
    out: dict[str, Any] = {"micro_batch": b, "seq": s, "hidden": h, "heads": a}
    torch.manual_seed(0)
    out.update(_block_parts(cfg, b, dev, reps))
    out["attention"] = _attention(b, s, h, a, dev, reps)
    for vocab in (cfg.vocab_size, padded):
        out[f"head_{vocab}_s"] = _head(b * s, h, vocab, cfg.vocab_size, dev, reps)
    out["optimizer_s"] = _optimizer(cfg, dev)

    # the planner's terms at the same shapes
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (dry run)"
    chip = CHIPS["h200"] if "H200" in name else CHIPS["h100"]
    lt = layer_time(chip, b, s, h, a)
    af, ab = attention_time(chip, b, s, h, a, 1, "sdpa", True)
    out["planner"] = {"chip": chip.name, "gemm_s": lt.gemm, "attention_fwd_s": af,
                      "attention_fwd_bwd_s": af + ab, "elementwise_s": lt.elementwise,
                      "layer_s": lt.total,
                      f"head_{cfg.vocab_size}_s": head_time(chip, b, s, h, cfg.vocab_size),
                      f"head_{padded}_s": head_time(chip, b, s, h, padded)}  # fmt: skip
    out["device"], out["torch"] = name, torch.__version__
    return out
