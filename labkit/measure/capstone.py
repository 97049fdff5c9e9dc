"""The capstone's GPU step: GPT-2 1.3B in bf16 with fp32 master weights, measured.

:func:`capstone_step` is what notebook 11's GPU cells and ``benchmarks/gpu_check.py`` run:
bf16 parameters with fp32 master weights and fused AdamW (stepped in chunks, so the fp32
gradient copy is one chunk at a time: the ZeRO paper's 2 + 2 + 12 bytes per parameter),
SDPA attention, optionally activation checkpointing of every block. The micro-batch is the
largest that :func:`labkit.memory.estimate.estimate` says fits in 85% of the card. It
reports tokens/s, MFU and ``torch.cuda.max_memory_allocated`` against the estimate.

MFU = tokens/s * (6N + 12*L*h*s) / peak (PaLM, Chowdhery et al. 2022, appendix B): N the
parameters without the position embedding (a lookup, no FLOPs), 12*L*h*s attention's score
and value matmuls forward and backward; recompute's extra forward is not model FLOPs.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from labkit.hardware import value

__all__ = [
    "PEAKS",
    "ChunkedMixedAdamW",
    "capstone_step",
    "model_flops_per_token",
    "padded_vocab",
    "peak_flops",
]

# bf16 dense peak FLOP/s (no sparsity), from the hardware catalog (data sheets, sources there);
# the first key a device name contains wins, so "H100 PCIe" is tried before "H100"
PEAKS = [
    ("H100 PCIe", value("h100_pcie.peak_bf16")),
    ("H100 NVL", value("h100_nvl.peak_bf16")),
    ("H100", value("h100.peak_bf16")),
    ("H200", value("h200.peak_bf16")),
    ("GH200", value("gh200.peak_bf16")),
    ("A100", value("a100.peak_bf16")),
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


class ChunkedMixedAdamW:
    """bf16 model parameters, fp32 master weights, fused AdamW stepped chunk by chunk: the
    ZeRO paper's 2 + 2 + 12 bytes per parameter plus one chunk's fp32 gradients."""

    def __init__(
        self, params: list[torch.nn.Parameter], chunk: int, lr: float = 1e-4, fused: bool = True
    ) -> None:
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
            torch.optim.AdamW([self.master[i] for i in idx], lr=lr, fused=fused, weight_decay=0.1)
            for idx in self.chunks
        ]

    @torch.no_grad()
    def step(self) -> None:
        for idx, opt in zip(self.chunks, self.opts):
            for i in idx:
                grad = self.params[i].grad
                assert grad is not None, "every parameter takes part in the loss"
                self.master[i].grad = grad.float()
                self.params[i].grad = None
            opt.step()
            for i in idx:
                self.params[i].copy_(self.master[i])
                self.master[i].grad = None


def padded_vocab(vocab_size: int, multiple: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple`` (Megatron's
    ``make_vocab_size_divisible_by``; nanoGPT's 50,304): the head's GEMM then has every
    dimension a multiple of 8 elements and stays on the tensor cores' fast path. The padded
    rows are never a target; they take part in the softmax, as in Megatron and nanoGPT."""
    if multiple < 1:
        raise ValueError(f"pad multiple must be >= 1, got {multiple}")
    return -(-vocab_size // multiple) * multiple


def capstone_step(
    recompute: str = "full",
    steps: int = 6,
    warmup: int = 3,
    preset_name: str = "gpt2-1.3b",
    *,
    micro_batch: int | None = None,
    pad_vocab_to: int = 1,
    compile_blocks: bool = False,
    device: str = "cuda",
) -> dict[str, Any]:
    """One measured configuration of the capstone step (module docstring).

    ``micro_batch``: None picks the largest the estimate fits in 85% of the card.
    ``pad_vocab_to``: round the vocabulary up to this multiple (64 gives GPT-2's 50,304); the
    model FLOPs stay those of the real vocabulary, so padding can only lower the MFU it
    reports. ``compile_blocks``: ``torch.compile`` each transformer block (the blocks share
    one compiled graph), which fuses LayerNorm, GELU and the residual adds.
    """
    from labkit.activation_checkpoint import apply_activation_checkpointing
    from labkit.memory.estimate import GIB, TrainSetup, estimate
    from labkit.models import GPT, lm_loss, preset

    if recompute not in ("none", "full"):
        raise ValueError(
            f"recompute must be 'none' or 'full' here, got {recompute!r} (with SDPA, "
            "Korthikanti's selective recompute stores nothing 'none' does not)"
        )
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    real = preset(preset_name)
    cfg = real.with_(vocab_size=padded_vocab(real.vocab_size, pad_vocab_to))
    seq, chunk = cfg.block_size, 64 * 2**20
    setup = TrainSetup(precision="bf16", recompute=recompute, grad_chunk_params=chunk)
    if micro_batch is None:
        capacity = torch.cuda.get_device_properties(dev).total_memory
        micro_batch = next(
            (b for b in (32, 24, 16, 12, 8, 6, 4, 2, 1)
             if estimate(cfg, setup, micro_batch=b).total < 0.85 * capacity), 1
        )  # fmt: skip
    b = micro_batch
    est = estimate(cfg, setup, micro_batch=b)
    torch.manual_seed(0)
    with dev:
        model = GPT(cfg)  # fp32 first: the master weights are copied exactly
    params = list(model.parameters())
    opt = ChunkedMixedAdamW(params, chunk, fused=cuda)
    model.to(torch.bfloat16)
    if recompute == "full":
        apply_activation_checkpointing(model.blocks, "full", impl="torch")
    if compile_blocks:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block)  # type: ignore[assignment]
    x = torch.randint(0, real.vocab_size, (b, seq), device=dev)  # never a padded id
    y = torch.roll(x, -1, 1)

    def step() -> float:
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    warmup_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step())
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    measured = torch.cuda.max_memory_allocated() if cuda else 0
    dt = statistics.median(times)
    n, fpt = model_flops_per_token(real, seq)
    tokens = b * seq / dt
    peak = peak_flops(torch.cuda.get_device_name()) if cuda else None
    out = {
        "recompute": recompute,
        "micro_batch": b,
        "seq": seq,
        "vocab_size": cfg.vocab_size,
        "compile_blocks": compile_blocks,
        "warmup_s": warmup_s,
        "params": cfg.num_params(),
        "N_for_flops": n,
        "flops_per_token": fpt,
        "flops_formula": "6N + 12*L*h*s (N of the unpadded vocabulary)",
        "step_s_median": dt,
        "step_s_min_max": [min(times), max(times)],
        "tokens_per_s": tokens,
        "mfu": tokens * fpt / peak if peak else None,
        "peak_flops": peak,
        "loss_first_last": [losses[0], losses[-1]],
        "max_memory_allocated_GiB": measured / GIB,
        "predicted_peak_allocated_GiB": est.peak_allocated / GIB,
        "predicted_over_measured": est.peak_allocated / measured if measured else None,
        "predicted_by_category_GiB": {k: v / GIB for k, v in est.by_category().items()},
    }
    return out
