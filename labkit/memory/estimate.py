"""Per-GPU memory of one training setup, by category: the ONE estimate behind the widget,
the capstone notebook and the GPU check.

Every formula comes from :mod:`labkit.memory.model`; this module only decides *what* each
GPU holds and asks the model for the bytes:

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

import math
from dataclasses import asdict, dataclass, replace

from labkit.memory.model import (
    FP32_ADAM,
    MIXED_ADAM,
    RECOMPUTE,
    STAGES,
    Precision,
    activation_bytes_per_layer,
    model_states,
)
from labkit.models.gpt import GPTConfig
from labkit.parallel.layout import ParallelDegrees

__all__ = [
    "CATEGORIES",
    "GB",
    "GIB",
    "PRECISIONS",
    "MemoryEstimate",
    "TrainSetup",
    "block_params",
    "estimate",
    "gpu_params",
    "measured_vs_predicted",
]

GB = 1e9
GIB = 2**30
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "workspace")

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
    zero: str = "ddp"  # one of labkit.memory.model.STAGES
    precision: str = "bf16"  # one of PRECISIONS
    recompute: str = "none"  # none / selective / full (Korthikanti)
    sp: bool = False  # sequence parallelism (needs tp > 1 to matter)
    offload_optimizer: bool = False  # optimizer state in host memory (ZeRO-Offload)
    # mixed precision: gradients upcast to fp32 this many at a time (0: all at once)
    grad_chunk_params: int = 64 * 2**20
    allowance: float = 0.5 * GIB  # stated fixed workspace: library buffers, allocator slack

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
        ParallelDegrees(self.dp, self.tp, self.pp)  # validates the degrees

    def with_(self, **changes: object) -> TrainSetup:
        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU by category; ``host_bytes`` is what CPU offload keeps in host memory."""

    parameters: float
    gradients: float
    optimizer_state: float
    activations: float
    workspace: float
    allowance: float
    host_bytes: float
    params_per_gpu: int

    @property
    def total(self) -> float:
        return sum(self.by_category().values())

    @property
    def peak_allocated(self) -> float:
        """The prediction for ``torch.cuda.max_memory_allocated``: total minus the allowance."""
        return self.total - self.allowance

    def by_category(self) -> dict[str, float]:
        return {c: getattr(self, c) for c in CATEGORIES}

    def fits(self, capacity_bytes: float) -> bool:
        return self.total <= capacity_bytes

    def headroom(self, capacity_bytes: float) -> float:
        """Bytes left (negative: by how much it does not fit)."""
        return capacity_bytes - self.total

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


def block_params(cfg: GPTConfig, tp: int = 1) -> int:
    """One block's parameters per tensor-parallel rank: the weights (12d^2) and the q/k/v/fc
    biases (7d) split ``tp`` ways; the two LayerNorms (4d) and the row-parallel biases of
    the two output projections (2d) replicated. ``tp=1``: ``12d^2 + 13d``."""
    d = cfg.n_embd
    return 12 * d * d // tp + 7 * d // tp + 6 * d


def _stage_params(cfg: GPTConfig, tp: int, pp: int) -> tuple[int, int]:
    """(first stage, last stage) parameters per tensor-parallel rank; equal when pp == 1."""
    d, t = cfg.n_embd, tp
    per_block = block_params(cfg, tp)
    vocab = -(-cfg.vocab_size // t) * t  # padded to a multiple of tp (vocab-parallel embedding)
    wte = vocab * d // t
    blocks = math.ceil(cfg.n_layer / pp) * per_block
    first = blocks + wte + cfg.block_size * d
    head = wte  # tied: the last stage keeps a copy of wte as the head; untied: its own head
    last = blocks + 2 * d + head
    if pp == 1:
        return first + 2 * d + (0 if cfg.tie_weights else head), first + 2 * d
    return first, last


def gpu_params(cfg: GPTConfig, tp: int = 1, pp: int = 1) -> int:
    """Parameters one GPU holds before ZeRO: the larger pipeline stage, per tp rank."""
    return max(_stage_params(cfg, tp, pp))


def estimate(cfg: GPTConfig, setup: TrainSetup | None = None, **changes: object) -> MemoryEstimate:
    """Per-GPU bytes by category for training ``cfg`` under ``setup`` (see the module doc)."""
    setup = (setup or TrainSetup()).with_(**changes) if changes else (setup or TrainSetup())
    ParallelDegrees(setup.dp, setup.tp, setup.pp).check_model(
        hidden=cfg.n_embd, heads=cfg.n_head, layers=cfg.n_layer
    )
    s = setup.seq or cfg.block_size
    if s > cfg.block_size:
        raise ValueError(f"seq={s} exceeds the model's block_size={cfg.block_size}")
    b, h, a, t, pp = setup.micro_batch, cfg.n_embd, cfg.n_head, setup.tp, setup.pp
    prec, elem = PRECISIONS[setup.precision]

    psi = gpu_params(cfg, t, pp)
    states = model_states(setup.zero, psi, setup.dp, prec)
    optim_gpu = 0.0 if setup.offload_optimizer else states.optimizer_state
    host = states.optimizer_state if setup.offload_optimizer else 0.0

    # Table 2 counts 16-bit tensors: scale by elem / 2 for fp32. SDPA never stores the core.
    scale = elem / 2
    stored = (
        "selective" if (setup.recompute == "none" and cfg.attention == "sdpa") else setup.recompute
    )
    layer = scale * activation_bytes_per_layer(s, b, h, a, tp=t, sp=setup.sp, recompute=stored)
    layers_per_stage = math.ceil(cfg.n_layer / pp)
    vocab_t = -(-cfg.vocab_size // t)
    logits = s * b * vocab_t * elem  # one (s, b, V/t) tensor
    first_stage = pp * layers_per_stage * layer  # 1F1B: pp micro-batches in flight
    last_stage = layers_per_stage * layer + 2 * logits  # logits + log-probabilities
    activations = max(first_stage, last_stage) if pp > 1 else layers_per_stage * layer + 2 * logits

    # Transients, which peak at different moments of the step (measured on an H200: adding
    # them up over-predicted the 1.3B step's peak by 15%, taking the larger is within 5%):
    # - backward starts by replacing the logits and log-probabilities by their gradients
    #   (net one (s, b, V/t) tensor more);
    # - later, layer by layer, recompute rebuilds one layer, and ZeRO-3 gathers its weights;
    # - the optimizer step, when the activations are gone, upcasts gradients to fp32.
    start = float(logits)
    per_layer = 0.0
    if setup.recompute != "none":
        core = "selective" if cfg.attention == "sdpa" else "none"
        per_layer += scale * activation_bytes_per_layer(
            s, b, h, a, tp=t, sp=setup.sp, recompute=core
        )
    if setup.zero == "zero3":
        per_layer += block_params(cfg, t) * prec.param_bytes  # the layer all-gathered for compute
    step = 0.0
    if prec is MIXED_ADAM:
        chunk = setup.grad_chunk_params or psi  # fp32 copy of the gradients being stepped
        shard = psi / setup.dp if setup.zero != "ddp" else psi
        step = 4 * min(chunk, shard)
    work = max(start, per_layer, step - activations)
    return MemoryEstimate(
        parameters=states.parameters,
        gradients=states.gradients,
        optimizer_state=optim_gpu,
        activations=activations,
        workspace=work + setup.allowance,
        allowance=setup.allowance,
        host_bytes=host,
        params_per_gpu=psi,
    )


def measured_vs_predicted(record: dict, est: MemoryEstimate) -> dict[str, tuple[float, float]]:
    """``{category: (measured, predicted)}`` for one rank's ledger from
    :func:`labkit.zero.measure` (each category's own peak; ``total``: the step's peak bytes
    against :attr:`MemoryEstimate.peak_allocated`)."""
    peak = record["peak"]
    rows = {c: (float(peak.get(c, 0)), float(getattr(est, c))) for c in CATEGORIES[:4]}
    rows["total"] = (float(record["peak_bytes"]), est.peak_allocated)
    return rows
