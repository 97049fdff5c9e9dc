"""Mixture-of-experts shapes: a small GPT for the labs, and two published MoEs as data.

A MoE transformer replaces some blocks' feed-forward MLP with ``E`` expert MLPs and a router
that sends each token to ``k`` of them (Shazeer et al. 2017; Switch, Fedus et al. 2021): the
parameters grow with ``E``, the FLOPs per token with ``k``. :class:`MoEConfig` is labkit's
small one (the GPT of :mod:`labkit.models.gpt` with GELU experts, built by
:func:`labkit.experts.model.moe_gpt`, which swaps the MLPs: this module, like every model,
knows nothing of how the layer is computed or distributed).

:class:`PublishedMoE` holds the layer shapes of two published models, for arithmetic only
(parameters, FLOPs per token, all-to-all bytes; nothing is built). Their counts are tested
against the totals the papers state:

* Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", arXiv:2401.04088, Table 1): 32 layers,
  d 4096, 32 query heads and 8 KV heads of 128, SwiGLU experts of hidden 14336, 8 experts,
  top-2, vocabulary 32000, untied head. Stated: 47B parameters, 13B active per token.
* DeepSeek-V3 (DeepSeek-AI 2024, arXiv:2412.19437, section 4.2): 61 layers, d 7168, the first
  3 dense (SwiGLU hidden 18432), the others 1 shared + 256 routed experts of hidden 2048, 8
  routed per token; multi-head latent attention with 128 heads of 128 (+ 64 rope dims), query
  rank 1536, KV rank 512; vocabulary 129280, untied head. Stated: 671B parameters, 37B active
  (the multi-token-prediction module's 14B not included).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from labkit.models.gpt import GPTConfig
from labkit.models.gpt import preset as gpt_preset

__all__ = ["MOE_PRESETS", "PUBLISHED_MOES", "MoEConfig", "PublishedMoE", "moe_preset"]


@dataclass(frozen=True)
class MoEConfig:
    """A GPT whose every ``moe_every``-th block (1: all) has a MoE feed-forward layer.

    ``expert_d_ff``: each expert's hidden width (GELU MLP d -> f -> d with biases);
    ``capacity_factor`` None: dropless; ``shared_d_ff`` > 0: a shared expert of that width;
    ``aux_coef``/``z_coef``: the balancing and z-loss coefficients (Switch uses 0.01; ST-MoE
    1e-3 for the z-loss).
    """

    gpt: GPTConfig
    n_experts: int = 4
    top_k: int = 2
    expert_d_ff: int = 256
    capacity_factor: float | None = 1.25
    shared_d_ff: int = 0
    moe_every: int = 1
    aux_coef: float = 0.01
    z_coef: float = 0.001

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, n_experts={self.n_experts}]")
        if self.expert_d_ff < 1 or self.moe_every < 1 or self.shared_d_ff < 0:
            raise ValueError(
                f"expert_d_ff={self.expert_d_ff} and moe_every={self.moe_every} must be >= 1, "
                f"shared_d_ff={self.shared_d_ff} >= 0"
            )

    def moe_layers(self) -> list[int]:
        """Indices of the blocks whose MLP is a MoE layer."""
        return [i for i in range(self.gpt.n_layer) if i % self.moe_every == self.moe_every - 1]

    def _moe_params(self, experts: int) -> int:
        d, f = self.gpt.n_embd, self.expert_d_ff
        shared = 2 * d * self.shared_d_ff + self.shared_d_ff + d if self.shared_d_ff else 0
        return experts * (2 * d * f + f + d) + shared + d * self.n_experts  # + the router

    def num_params(self) -> int:
        """All parameters: the GPT's, with each MoE block's MLP (8d^2 + 5d) replaced."""
        d = self.gpt.n_embd
        swap = self._moe_params(self.n_experts) - (8 * d * d + 5 * d)
        return self.gpt.num_params() + len(self.moe_layers()) * swap

    def active_params(self) -> int:
        """Parameters one token's forward touches (k of the E experts, embeddings included)."""
        unused = (self.n_experts - self.top_k) * (2 * self.gpt.n_embd * self.expert_d_ff)
        unused += (self.n_experts - self.top_k) * (self.expert_d_ff + self.gpt.n_embd)
        return self.num_params() - len(self.moe_layers()) * unused

    def with_(self, **changes: object) -> MoEConfig:
        return replace(self, **changes)  # type: ignore[arg-type]


MOE_PRESETS: dict[str, MoEConfig] = {
    # the labs' MoE: tiny-shakespeare's 2-layer GPT, 4 experts of the dense MLP's width, top-2
    "tiny-moe": MoEConfig(gpt=gpt_preset("tiny"), n_experts=4, top_k=2, expert_d_ff=256),
}


def moe_preset(name: str, **changes: object) -> MoEConfig:
    if name not in MOE_PRESETS:
        raise ValueError(f"unknown MoE preset {name!r}; expected one of {sorted(MOE_PRESETS)}")
    return MOE_PRESETS[name].with_(**changes) if changes else MOE_PRESETS[name]


@dataclass(frozen=True)
class PublishedMoE:
    """A published MoE's shapes (SwiGLU experts: 3 d f weights each, no biases).

    ``attention``: parameters of one layer's attention (its own formula per model, below);
    ``dense_layers`` leading layers have a dense SwiGLU FFN of ``dense_d_ff``; the rest
    ``n_experts`` routed (``top_k`` per token) + ``n_shared`` experts of ``expert_d_ff``.
    ``stated_total``/``stated_active``: what the paper says, for the tests.
    """

    name: str
    source: str
    d: int
    layers: int
    vocab: int
    attention: int
    n_experts: int
    top_k: int
    expert_d_ff: int
    n_shared: int = 0
    dense_layers: int = 0
    dense_d_ff: int = 0
    stated_total: float = 0.0
    stated_active: float = 0.0

    @property
    def expert_params(self) -> int:
        return 3 * self.d * self.expert_d_ff  # SwiGLU: gate, up, down

    def _counts(self, experts_per_layer: int) -> int:
        moe_layers = self.layers - self.dense_layers
        per_moe = (experts_per_layer + self.n_shared) * self.expert_params
        per_moe += self.d * self.n_experts  # router
        dense = self.dense_layers * 3 * self.d * self.dense_d_ff
        norms = 2 * self.d * self.layers + self.d
        embeddings = 2 * self.vocab * self.d  # input embedding and untied head
        return self.layers * self.attention + moe_layers * per_moe + dense + norms + embeddings

    def total_params(self) -> int:
        return self._counts(self.n_experts)

    def active_params(self) -> int:
        """Per token: ``top_k`` routed experts (and the shared ones) instead of all of them."""
        return self._counts(self.top_k)


def _gqa(d: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """q and o: d x heads*hd each; k and v: d x kv_heads*hd each (no biases)."""
    return 2 * d * heads * head_dim + 2 * d * kv_heads * head_dim


def _mla(d: int, heads: int, q_rank: int, kv_rank: int, nope: int, rope: int, v: int) -> int:
    """DeepSeek's multi-head latent attention: down-projections to the query rank and to the
    KV rank (+ the shared rope key), their norms, up-projections per head, the output."""
    q = d * q_rank + q_rank + q_rank * heads * (nope + rope)
    kv = d * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v)
    return q + kv + heads * v * d


PUBLISHED_MOES: dict[str, PublishedMoE] = {
    "mixtral-8x7b": PublishedMoE(
        "Mixtral 8x7B", "Jiang et al. 2024, arXiv:2401.04088, Table 1",
        d=4096, layers=32, vocab=32000, attention=_gqa(4096, 32, 8, 128),
        n_experts=8, top_k=2, expert_d_ff=14336, stated_total=47e9, stated_active=13e9,
    ),
    "deepseek-v3": PublishedMoE(
        "DeepSeek-V3", "DeepSeek-AI 2024, arXiv:2412.19437, section 4.2",
        d=7168, layers=61, vocab=129280, attention=_mla(7168, 128, 1536, 512, 128, 64, 128),
        n_experts=256, top_k=8, expert_d_ff=2048, n_shared=1, dense_layers=3,
        dense_d_ff=18432, stated_total=671e9, stated_active=37e9,
    ),
}  # fmt: skip
