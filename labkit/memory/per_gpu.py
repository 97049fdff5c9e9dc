"""The one per-GPU memory model: what a GPU holds at its step's peak, by category.

Both :func:`labkit.memory.estimate.estimate` (a :class:`~labkit.memory.estimate.TrainSetup`)
and the planner (:mod:`labkit.planner.memory`, a candidate layout) call :func:`gpu_memory`;
they differ only in the inputs they pass (the planner: Megatron's 18 bytes per parameter, a
1 GB allowance, the micro-batches a schedule keeps in flight). Every formula is
:mod:`labkit.memory.model`'s:

* **parameters** one GPU owns (Megatron's split: weight matrices and q/k/v/fc biases ``tp``
  ways, LayerNorms and the two row-parallel biases replicated, the vocabulary padded and
  split; ``blocks`` layers a pipeline rank, the embedding on the first stage, a tied copy as
  the head on the last), then ZeRO over the ``shard`` ranks (the dp group, or a node's share
  of it under HSDP) with :func:`~labkit.memory.model.model_states`. CPU offload (ZeRO-Offload,
  Ren et al. 2021) moves the optimizer state, and with ``"optimizer+grads"`` the gradients
  and the optimizer step, to host memory (``host_bytes``);
* **activations**: Korthikanti et al. 2022 Table 2 per layer
  (:func:`~labkit.memory.model.activation_bytes_per_layer`) x ``blocks`` x the micro-batches
  in flight on the first stage (1F1B: ``pp``). The attention kernel is an input: SDPA
  (FlashAttention) never stores the ``5as^2b`` score term, so it stores Table 2's "selective"
  row without recompute; an explicit (eager) softmax stores it. The head keeps the logits
  and log-probabilities, ``2 s b V/t`` elements, on the last stage;
* **workspace**: the largest transient of three moments (backward's start: the logits'
  gradient, ``s b V/t`` elements; one layer's backward: the layer rebuilt under recompute,
  ZeRO-3's all-gathered layer, ZeRO-Offload's staging of one layer's gradients; the optimizer
  step: a chunk of 16-bit gradients upcast to fp32, less the freed activations), plus a
  stated ``allowance`` (library workspaces, allocator slack).

Experts and context parallelism (:mod:`labkit.memory.moe_cp`, which has the arithmetic):
with a :class:`~labkit.memory.moe_cp.MoESpec` a MoE layer's routed experts are *expert*
parameters, ``E / ep`` of them a rank, their gradients and optimizer state sharded by ZeRO
over ``expert_shard`` ranks (default ``shard / ep``: the ``dp cp / ep`` ranks holding the same
experts), everything else *dense* as before over ``shard`` (the caller passes ``dp x cp``:
context-parallel ranks hold the same parameters); a MoE layer's activations replace the dense
MLP's by its routed slots, the capacity factor's padding, the router and a shared expert. With
``cp > 1`` every activation and the logits cover ``seq / cp`` positions, and the ring's K/V
buffers in flight join the per-layer transients.

Measured on an H200 (``docs/gpu_check_h200.json``, the 1.3B step, SDPA, micro-batch 24):
103.5 GiB allocated at peak; this model predicts 109.9 GiB (+6%).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from labkit.memory.model import Precision, activation_bytes_per_layer, model_states
from labkit.memory.moe_cp import MoESpec, dense_mlp_params, moe_activation_bytes, ring_kv_in_flight
from labkit.models.gpt import GPTConfig

__all__ = [
    "ATTENTION", "CATEGORIES", "GB", "GIB", "OFFLOAD", "STAGE_ROLES", "MemoryEstimate",
    "block_params",
    "gpu_memory", "gpu_params", "stage_params", "stored_layer_bytes",
]  # fmt: skip

GB = 1e9
GIB = 2**30
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "workspace")
# the attention kernel: "sdpa" (fused, FlashAttention-style: scores never stored) or
# "explicit" (eager softmax(QK^T)V: the 5as^2b score term stored); GPTConfig's names
ATTENTION = ("sdpa", "explicit")
# CPU offload: the optimizer state; or (ZeRO-Offload) also the gradients and the step
OFFLOAD = ("none", "optimizer", "optimizer+grads")
STAGE_ROLES = ("fullest", "first", "middle", "last")  # which pipeline rank gpu_memory charges


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
    params_per_gpu: int  # dense and expert parameters, before ZeRO
    expert_params_per_gpu: float = 0.0  # of which the routed experts (E / ep of them)
    moe_padding: float = 0.0  # activation bytes of the capacity factor's empty slots

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


def stage_params(cfg: GPTConfig, tp: int, pp: int, blocks: int | None = None) -> tuple[int, int]:
    """(first stage, last stage) parameters per tensor-parallel rank, each holding ``blocks``
    layers (default ``ceil(L/pp)``); equal when pp == 1."""
    d, t = cfg.n_embd, tp
    vocab = -(-cfg.vocab_size // t) * t  # padded to a multiple of tp (vocab-parallel embedding)
    wte = vocab * d // t
    n_blocks = math.ceil(cfg.n_layer / pp) if blocks is None else blocks
    body = n_blocks * block_params(cfg, tp)
    first = body + wte + cfg.block_size * d
    head = wte  # tied: the last stage keeps a copy of wte as the head; untied: its own head
    last = body + 2 * d + head
    if pp == 1:
        return first + 2 * d + (0 if cfg.tie_weights else head), first + 2 * d
    return first, last


def gpu_params(cfg: GPTConfig, tp: int = 1, pp: int = 1, blocks: int | None = None) -> int:
    """Parameters one GPU holds before ZeRO: the larger pipeline stage, per tp rank."""
    return max(stage_params(cfg, tp, pp, blocks))


def stored_layer_bytes(
    cfg: GPTConfig, seq: int, batch: int, *, tp: int = 1, sp: bool = False,
    recompute: str = "none", attention: str = "sdpa", act_bytes: int = 2,
) -> float:  # fmt: skip
    """Bytes one layer keeps for backward (Korthikanti Table 2, scaled from 16-bit to
    ``act_bytes``): SDPA stores Table 2's selective row when nothing is recomputed."""
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r}: expected one of {ATTENTION}")
    stored = "selective" if (recompute == "none" and attention == "sdpa") else recompute
    h, a = cfg.n_embd, cfg.n_head
    return act_bytes / 2 * activation_bytes_per_layer(
        seq, batch, h, a, tp=tp, sp=sp, recompute=stored
    )


def gpu_memory(
    cfg: GPTConfig, *, micro_batch: int, seq: int, shard: int, tp: int, pp: int, zero: str,
    precision: Precision, act_bytes: int, recompute: str, sp: bool, attention: str,
    offload: str = "none", blocks: int | None = None, in_flight: float | None = None,
    grad_chunk_params: int = 64 * 2**20, allowance: float = 0.5 * GIB, stage: str = "fullest",
    cp: int = 1, ep: int = 1, moe: MoESpec | None = None, expert_shard: int | None = None,
) -> MemoryEstimate:  # fmt: skip
    """Per-GPU bytes (module docstring). ``shard``: the ranks ZeRO shards the dense parameters
    over; ``blocks``: the most layers one pipeline rank holds (default ``ceil(L/pp)``);
    ``in_flight``: the micro-batches the first stage stashes (default ``pp``, 1F1B's).
    ``stage``: which pipeline rank (pp > 1): "fullest" (the larger of the first stage, with
    the embedding and ``in_flight`` micro-batches, and the last, with the head and one), or
    exactly one rank holding ``blocks`` layers and ``in_flight`` micro-batches: "first" (the
    embedding), "middle" or "last" (the head, its logits and their gradient). ``cp``, ``ep``,
    ``moe``, ``expert_shard``: context and expert parallelism (module docstring)."""
    if stage not in STAGE_ROLES:
        raise ValueError(f"stage={stage!r}: expected one of {STAGE_ROLES}")
    if offload not in OFFLOAD:
        raise ValueError(f"offload={offload!r}: expected one of {OFFLOAD}")
    if cp < 1 or seq % cp or (cp > 1 and attention != "sdpa"):
        raise ValueError(f"cp={cp}, seq={seq}, attention={attention!r}: cp must divide seq, "
                         "and ring attention is blockwise (attention='sdpa')")  # fmt: skip
    if ep < 1 or (ep > 1 and (moe is None or moe.n_experts % ep)):
        raise ValueError(f"ep={ep} needs a MoE model whose experts it divides "
                         f"(n_experts={moe.n_experts if moe else None})")  # fmt: skip
    s, b, t, elem = seq // cp, micro_batch, tp, act_bytes  # s: this rank's positions
    n_blocks = math.ceil(cfg.n_layer / pp) if blocks is None else blocks
    role = "fullest" if pp == 1 else stage
    first_p, last_p = stage_params(cfg, t, pp, n_blocks)
    psi = {"fullest": max(first_p, last_p), "first": first_p, "last": last_p,
           "middle": n_blocks * block_params(cfg, t)}[role]  # fmt: skip
    h, n_moe = cfg.n_embd, moe.moe_blocks(cfg.n_layer, n_blocks) if moe else 0
    dense_psi, expert_psi, layer_psi = float(psi), 0.0, float(block_params(cfg, t))
    if moe is not None:  # a MoE layer: dense MLP out, router and shared expert in; experts
        dense_psi += n_moe * (moe.dense_extra(h, t) - dense_mlp_params(h, t))
        expert_psi = n_moe * moe.n_experts // ep * moe.expert_params(h, t)
        layer_psi += moe.dense_extra(h, t) - dense_mlp_params(h, t)
        layer_psi += moe.n_experts // ep * moe.expert_params(h, t)
    e_shard = max(1, shard // ep) if expert_shard is None else expert_shard
    dense = model_states(zero, dense_psi, shard, precision)
    experts = model_states(zero, expert_psi, e_shard, precision)
    states = [dense.parameters + experts.parameters, dense.gradients + experts.gradients,
              dense.optimizer_state + experts.optimizer_state]  # fmt: skip
    off_opt, off_grad = offload != "none", offload == "optimizer+grads"
    host = (states[2] if off_opt else 0.0) + (states[1] if off_grad else 0.0)

    layer = stored_layer_bytes(cfg, s, b, tp=t, sp=sp, recompute=recompute,
                               attention=attention, act_bytes=elem)  # fmt: skip
    moe_parts = moe_activation_bytes(moe, s * b, h, tp=t, sp=sp, elem=elem) if moe else {}
    moe_delta = 0.0  # a MoE layer's bytes beyond a dense one's (none under full recompute)
    if moe and recompute != "full":
        kept = ("routed", "padding", "router", "shared")
        moe_delta = sum(moe_parts[k] for k in kept) - moe_parts["replaces"]
    logits = s * b * -(-cfg.vocab_size // t) * elem  # one (s/cp, b, V/t) tensor
    body = n_blocks * layer + n_moe * moe_delta
    stash = (pp if in_flight is None else in_flight) * body
    head = role in ("fullest", "last")  # holds the logits and log-probabilities
    if role == "fullest":
        activations = max(stash, body + 2 * logits) if pp > 1 else body + 2 * logits
    else:
        activations = stash + (2 * logits if head else 0)

    # Transients peak at different moments (measured on an H200: adding them up
    # over-predicted the 1.3B step's peak by 15%, taking the larger is within 5%).
    per_layer = ring_kv_in_flight(s * b, h, tp=t, elem=elem) if cp > 1 else 0.0
    if recompute != "none":  # one layer rebuilt in full (its core too, unless SDPA)
        per_layer += stored_layer_bytes(cfg, s, b, tp=t, sp=sp, attention=attention,
                                        act_bytes=elem)  # fmt: skip
        per_layer += max(0.0, moe_delta if n_moe else 0.0)
    if zero == "zero3":
        per_layer += layer_psi * precision.param_bytes  # the layer all-gathered
    if off_grad:
        per_layer += layer_psi * precision.grad_bytes  # staged before the copy out
    step = 0.0
    total_psi = dense_psi + expert_psi
    if precision.mixed and not off_opt:  # the step upcasts a chunk of gradients to fp32
        chunk = grad_chunk_params or total_psi
        own = dense_psi / shard + expert_psi / e_shard if zero != "ddp" else total_psi
        step = 4 * min(chunk, own)
    work = max(float(logits) if head else 0.0, per_layer, step - activations)
    stashed = (pp if in_flight is None else in_flight) if role != "last" else 1
    padding = stashed * n_moe * moe_parts["padding"] if moe_delta else 0.0
    return MemoryEstimate(
        parameters=states[0],
        gradients=0.0 if off_grad else states[1],
        optimizer_state=0.0 if off_opt else states[2],
        activations=activations,
        workspace=work + allowance,
        allowance=allowance,
        host_bytes=host,
        params_per_gpu=round(total_psi),
        expert_params_per_gpu=expert_psi,
        moe_padding=padding,
    )
