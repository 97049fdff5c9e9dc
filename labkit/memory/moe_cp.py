"""What experts and context parallelism change in one GPU's memory: pure arithmetic.

:func:`labkit.memory.per_gpu.gpu_memory` calls these; the planner's time side reads the same
:class:`MoESpec`. Symbols: hidden ``h``, tensor-parallel degree ``t``, ``T`` tokens of one
micro-batch on this rank (``b s / cp``), ``E`` experts of hidden ``f``, ``k`` per token,
capacity factor ``cf``, element bytes ``e``.

* **Parameters of a MoE layer** (per tp rank): the block's attention and LayerNorms as dense
  (:func:`~labkit.memory.per_gpu.block_params` less the dense MLP's ``8h^2/t + 4h/t + h``), the
  router (``h E``, replicated) and a shared expert (``/t``) are *dense*: every rank of the
  ``dp x cp`` group holds them. The ``E`` routed experts (each split ``t`` ways like a dense
  MLP) are *expert* parameters: an ``ep`` group shards them, ``E / ep`` a rank
  (:func:`labkit.experts.costs.expert_memory_per_rank`), and ZeRO then shards those over the
  ``dp cp / ep`` ranks holding the same experts (the ``edp`` group of
  :func:`labkit.parallel.layout.rank_grid`).
* **Activations of a MoE layer**: Korthikanti's MLP keeps two ``4h/t``-wide tensors (the fc
  output and the GeLU output: ``8 h T / t`` elements); a MoE layer keeps instead, per routed
  slot, the dispatched input row (``h``, split ``t`` ways under sequence parallelism), the
  expert's hidden tensors (``2f/t`` for GeLU, ``3f/t`` for SwiGLU: gate, up and their product)
  and the expert's output row before the weighted combine (``h``, same split); plus the
  router's float32 probabilities (``4 T E`` bytes) and the shared expert's hidden tensors.
  Slots: ``k T`` dropless; with a capacity factor the padded (GShard) dispatch keeps
  ``E C`` slots, ``C = ceil(cf k T / E)``, of which ``E C - k T`` carry no token: the
  **padding** (:func:`labkit.experts.costs.capacity_padding` is its fraction). Under uniform
  routing ``ep`` does not change them: a rank receives as many rows as it sends.
* **Context parallelism** (ring attention, :mod:`labkit.context_parallel.cost`): each rank keeps
  only its ``s / cp`` positions, so every activation (Korthikanti's terms are linear in ``s``
  once a flash-style kernel drops ``5 a s^2 b``) and the logits divide by ``cp``. In flight
  besides (a transient, in ``workspace``): the ring double-buffers K/V, forward one block
  computing and one arriving, ``2 x 2 T h/t e`` bytes; backward the same plus their float32
  gradients travelling with them, ``2 x 2 T h/t (e + 4)``. A ring never forms the score
  matrix, so an explicit (eager) softmax with ``cp > 1`` is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from labkit.models.gpt import GPTConfig
from labkit.models.moe import MoEConfig, PublishedMoE

__all__ = [
    "MoESpec", "dense_mlp_params", "moe_activation_bytes", "ring_kv_in_flight",
]  # fmt: skip


@dataclass(frozen=True)
class MoESpec:
    """The MoE side of a GPT: every ``moe_every``-th block after ``first_dense`` dense ones
    replaces its MLP by ``n_experts`` experts of hidden ``expert_d_ff`` (``top_k`` per token,
    ``capacity_factor`` None: dropless) and optionally a shared expert of ``shared_d_ff``."""

    n_experts: int
    top_k: int
    expert_d_ff: int
    capacity_factor: float | None = 1.25
    shared_d_ff: int = 0
    glu: bool = True  # SwiGLU experts (3 h f weights) or GeLU (2 h f)
    bias: bool = False  # the experts' biases (f + h each; labkit's MoEConfig has them)
    moe_every: int = 1
    first_dense: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.n_experts or self.expert_d_ff < 1 or self.moe_every < 1:
            raise ValueError(
                f"need 1 <= top_k <= n_experts, expert_d_ff >= 1, moe_every >= 1; got "
                f"top_k={self.top_k} n_experts={self.n_experts} "
                f"expert_d_ff={self.expert_d_ff} moe_every={self.moe_every}"
            )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor={self.capacity_factor} must be > 0 (or None)")

    @classmethod
    def from_config(cls, moe: MoEConfig) -> MoESpec:
        """labkit's MoE GPT (:class:`~labkit.models.moe.MoEConfig`): GeLU experts with biases."""
        return cls(moe.n_experts, moe.top_k, moe.expert_d_ff, moe.capacity_factor,
                   moe.shared_d_ff, glu=False, bias=True, moe_every=moe.moe_every)  # fmt: skip

    @classmethod
    def from_published(
        cls, pub: PublishedMoE, *, seq: int = 4096, capacity_factor: float | None = 1.25,
        heads: int = 32,
    ) -> tuple[GPTConfig, MoESpec]:  # fmt: skip
        """A published MoE's shapes as (GPT, spec): SwiGLU experts, no biases, an untied head.
        The GPT's attention is multi-head (``4 h^2``), so grouped-query or latent attention is
        priced as full MHA (an upper bound on its parameters and K/V bytes)."""
        cfg = GPTConfig(vocab_size=pub.vocab, block_size=seq, n_layer=pub.layers,
                        n_head=heads, n_embd=pub.d, tie_weights=False)  # fmt: skip
        return cfg, cls(pub.n_experts, pub.top_k, pub.expert_d_ff, capacity_factor,
                        pub.n_shared * pub.expert_d_ff, first_dense=pub.dense_layers)  # fmt: skip

    def moe_layers(self, n_layer: int) -> int:
        """How many of ``n_layer`` blocks are MoE."""
        return sum(1 for i in range(self.first_dense, n_layer)
                   if (i - self.first_dense) % self.moe_every == self.moe_every - 1)  # fmt: skip

    def moe_blocks(self, n_layer: int, blocks: int) -> int:
        """MoE blocks among ``blocks`` of one pipeline rank: all when every block is MoE,
        else the share rounded up (an upper bound; MoE layers spread over the stages)."""
        n = self.moe_layers(n_layer)
        return blocks if n == n_layer else min(blocks, math.ceil(blocks * n / n_layer))

    def expert_params(self, h: int, tp: int = 1) -> float:
        """One routed expert's parameters per tp rank."""
        f = self.expert_d_ff
        return (3 if self.glu else 2) * h * f / tp + ((f / tp + h) if self.bias else 0)

    def dense_extra(self, h: int, tp: int = 1) -> float:
        """A MoE layer's dense parameters beyond the attention: router and shared expert."""
        fs = self.shared_d_ff
        return h * self.n_experts + (3 if self.glu else 2) * h * fs / tp

    def slots(self, tokens: float) -> tuple[float, float]:
        """(routed rows, padded slots) for ``tokens``: ``k T`` and ``E C - k T``."""
        routed = self.top_k * tokens
        if self.capacity_factor is None:
            return routed, 0.0
        cap = math.ceil(self.capacity_factor * routed / self.n_experts)
        return routed, max(0.0, self.n_experts * cap - routed)


def dense_mlp_params(h: int, tp: int = 1) -> float:
    """The dense GPT MLP a MoE layer replaces: fc and fc2 weights and fc's bias split ``tp``
    ways, fc2's bias replicated (:func:`~labkit.memory.per_gpu.block_params`'s split)."""
    return 8 * h * h / tp + 4 * h / tp + h


def moe_activation_bytes(
    spec: MoESpec, tokens: float, h: int, *, tp: int = 1, sp: bool = False, elem: int = 2
) -> dict[str, float]:
    """Bytes one MoE layer keeps for backward beyond the attention and LayerNorms, by part
    (module docstring): ``routed`` (the ``k T`` slots), ``padding`` (the empty ``E C - k T``),
    ``router``, ``shared``; ``replaces``: the dense MLP's ``8 h T / t`` elements they stand for."""
    t = tp
    row = 2 * h / (t if sp else 1) + (3 if spec.glu else 2) * spec.expert_d_ff / t
    routed, pad = spec.slots(tokens)
    shared = (3 if spec.glu else 2) * spec.shared_d_ff / t * tokens * elem
    return {"routed": routed * row * elem, "padding": pad * row * elem,
            "router": 4.0 * tokens * spec.n_experts, "shared": shared,
            "replaces": 8 * h * tokens / t * elem}  # fmt: skip


def ring_kv_in_flight(tokens: float, h: int, *, tp: int = 1, elem: int = 2) -> float:
    """Ring attention's K/V buffers one layer's backward holds (module docstring): two blocks
    of K and V (``2 T h/t`` elements each), with their float32 gradients."""
    return 2 * (2 * tokens * h / tp) * (elem + 4)
