"""Per-GPU memory of one training setup, by category: the ONE estimate behind the widget,
the capstone notebook and the GPU check.

Every formula comes from :mod:`labkit.memory.model`, assembled by the ONE per-GPU model
:func:`labkit.memory.per_gpu.gpu_memory` that the planner calls too (``labkit.planner.memory``);
this module turns a :class:`TrainSetup` into its inputs. What each GPU holds:

* **model states** (parameters, gradients, optimizer state): the parameters one GPU owns
  under tensor parallelism (Megatron: weight matrices and the q/k/v/fc biases split ``tp``
  ways, the LayerNorms and the two row-parallel biases replicated, the vocabulary split) and
  pipeline parallelism (``ceil(L/pp)`` blocks, the embedding on the first stage, a copy of
  the tied embedding as the head on the last), then ZeRO over ``dp`` with
  :func:`~labkit.memory.model.model_states`. CPU offload moves the optimizer state to the
  host (ZeRO-Offload, Ren et al. 2021): it appears in ``host_bytes``, not on the GPU.
* **activations**: :func:`~labkit.memory.model.activation_bytes_per_layer` (Korthikanti
  Table 2) per layer, times the layers a stage holds, times the micro-batches a 1F1B
  pipeline keeps in flight on its first stage (``pp``: Korthikanti section 4.2.3, so the
  first stage holds ``L`` layers' worth whatever ``pp`` is). SDPA attention (FlashAttention
  kernels) never stores the ``5as^2b`` attention core, so with ``attention="sdpa"`` the
  stored bytes are Table 2's "selective" row even without recompute. The head stores the
  logits and the loss's log-probabilities, ``2 * s*b*V/t`` elements. Table 2 counts 16-bit
  activations; fp32 training stores every tensor at twice the bytes.
* **workspace**: what lives only for part of a step, on top of the above, taking the
  largest of three moments: the start of backward (the logits' gradients, net ``s*b*V/t``
  elements more), a layer's backward (one layer's activations rebuilt under recompute plus
  ZeRO-3's all-gathered layer) and the optimizer step (activations gone; the fp32 copy of
  one chunk of gradients in a mixed-precision step), plus a stated fixed ``allowance``
  (cuBLAS/NCCL workspaces and allocator slack; default 0.5 GiB).

``peak_allocated`` (everything but the allowance) is the number to hold against
``torch.cuda.max_memory_allocated``; ``total`` against the card's capacity.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from labkit.memory.fp8 import fp8_activation_saving, fp8_weight_copy_bytes
from labkit.memory.model import FP32_ADAM, MIXED_ADAM, RECOMPUTE, STAGES, Precision
from labkit.memory.moe_cp import MoESpec
from labkit.memory.per_gpu import (
    CATEGORIES,
    GB,
    GIB,
    MemoryEstimate,
    block_params,
    gpu_memory,
    gpu_params,
)
from labkit.models.gpt import GPTConfig
from labkit.parallel.layout import ParallelDegrees

__all__ = [
    "CATEGORIES",
    "GB",
    "GIB",
    "PRECISIONS",
    "MemoryEstimate",
    "MoESpec",
    "TrainSetup",
    "block_params",
    "estimate",
    "gpu_params",
    "measured_vs_predicted",
]

# precision -> (bytes per parameter of each model state, bytes per stored activation element)
# "bf16-autocast": fp32 weights, gradients and Adam moments; autocast computes in bf16.
PRECISIONS: dict[str, tuple[Precision, int]] = {
    "fp32": (FP32_ADAM, 4),
    "bf16": (MIXED_ADAM, 2),
    "fp16": (MIXED_ADAM, 2),
    "bf16-autocast": (FP32_ADAM, 2),
}


@dataclass(frozen=True)
class TrainSetup:
    """One training configuration: how the model is split and trained (per GPU)."""

    micro_batch: int = 1
    seq: int | None = None  # None: the model's block_size
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallelism: each rank holds seq / cp positions (ring attention)
    ep: int = 1  # expert parallelism: E / ep experts a rank (a MoE model only)
    zero: str = "ddp"  # one of labkit.memory.model.STAGES
    precision: str = "bf16"  # one of PRECISIONS
    recompute: str = "none"  # none / selective / full (Korthikanti)
    sp: bool = False  # sequence parallelism (needs tp > 1 to matter)
    offload_optimizer: bool = False  # optimizer state in host memory (ZeRO-Offload)
    # mixed precision: gradients upcast to fp32 this many at a time (0: all at once)
    grad_chunk_params: int = 64 * 2**20
    allowance: float = 0.5 * GIB  # stated fixed workspace: library buffers, allocator slack
    fp8: bool = False  # FP8 linears: inputs saved in one byte, weight copies kept (memory/fp8)

    def __post_init__(self) -> None:
        if self.zero not in STAGES:
            raise ValueError(f"unknown ZeRO stage {self.zero!r}; expected one of {STAGES}")
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"unknown precision {self.precision!r}; expected one of {sorted(PRECISIONS)}"
            )
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"unknown recompute {self.recompute!r}; expected one of {RECOMPUTE}")
        if self.micro_batch < 1 or (self.seq is not None and self.seq < 1):
            raise ValueError(
                f"need micro_batch >= 1 and seq >= 1, got {self.micro_batch}, {self.seq}"
            )
        if self.allowance < 0 or self.grad_chunk_params < 0:
            raise ValueError(
                "allowance and grad_chunk_params must be >= 0, "
                f"got {self.allowance}, {self.grad_chunk_params}"
            )
        ParallelDegrees(self.dp, self.tp, self.pp, cp=self.cp, ep=self.ep)  # validates them

    def with_(self, **changes: object) -> TrainSetup:
        return replace(self, **changes)  # type: ignore[arg-type]


def estimate(
    cfg: GPTConfig, setup: TrainSetup | None = None, *, moe: MoESpec | None = None,
    **changes: object,
) -> MemoryEstimate:  # fmt: skip
    """Per-GPU bytes by category for training ``cfg`` under ``setup``: the one memory model,
    :func:`labkit.memory.per_gpu.gpu_memory`, with ZeRO over the whole dp group (``dp x cp``:
    context-parallel ranks hold the same parameters; the experts over ``dp cp / ep``), 1F1B's
    ``pp`` micro-batches in flight and ``cfg.attention`` as the attention kernel. ``moe``: the
    model's MoE layers (:class:`~labkit.memory.moe_cp.MoESpec`), needed for ``ep > 1``."""
    setup = (setup or TrainSetup()).with_(**changes) if changes else (setup or TrainSetup())
    s = setup.seq or cfg.block_size
    ParallelDegrees(setup.dp, setup.tp, setup.pp, cp=setup.cp, ep=setup.ep).check_model(
        hidden=cfg.n_embd, heads=cfg.n_head, layers=cfg.n_layer, seq=s
    )
    if s > cfg.block_size:
        raise ValueError(f"seq={s} exceeds the model's block_size={cfg.block_size}")
    prec, elem = PRECISIONS[setup.precision]
    est = gpu_memory(
        cfg, micro_batch=setup.micro_batch, seq=s, shard=setup.dp * setup.cp, tp=setup.tp,
        pp=setup.pp, cp=setup.cp, ep=setup.ep, moe=moe,
        zero=setup.zero, precision=prec, act_bytes=elem, recompute=setup.recompute,
        sp=setup.sp, attention=cfg.attention,
        offload="optimizer" if setup.offload_optimizer else "none",
        grad_chunk_params=setup.grad_chunk_params, allowance=setup.allowance,
    )  # fmt: skip
    return _with_fp8(est, cfg, setup, s) if setup.fp8 else est


def _with_fp8(est: MemoryEstimate, cfg: GPTConfig, setup: TrainSetup, seq: int
              ) -> MemoryEstimate:  # fmt: skip
    """FP8 linears (:mod:`labkit.memory.fp8`): the first stage's ``ceil(L/pp)`` layers times
    ``pp`` micro-batches in flight keep their linears' inputs in one byte, and each layer its
    weights' FP8 copy (none under full recompute: the rerun forward makes it again)."""
    blocks = -(-cfg.n_layer // setup.pp)
    saved = fp8_activation_saving(seq // setup.cp, setup.micro_batch, cfg.n_embd, tp=setup.tp,
                                  sp=setup.sp, recompute=setup.recompute)  # fmt: skip
    copies = 0.0 if setup.recompute == "full" else fp8_weight_copy_bytes(cfg.n_embd, blocks,
                                                                          setup.tp)  # fmt: skip
    return replace(est, activations=est.activations - saved * blocks * setup.pp + copies)


def measured_vs_predicted(record: dict, est: MemoryEstimate) -> dict[str, tuple[float, float]]:
    """``{category: (measured, predicted)}`` for one rank's ledger from
    :func:`labkit.zero.measure` (each category's own peak; ``total``: the step's peak bytes
    against :attr:`MemoryEstimate.peak_allocated`)."""
    peak = record["peak"]
    rows = {c: (float(peak.get(c, 0)), float(getattr(est, c))) for c in CATEGORIES[:4]}
    rows["total"] = (float(record["peak_bytes"]), est.peak_allocated)
    return rows
